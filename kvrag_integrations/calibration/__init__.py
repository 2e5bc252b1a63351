"""Blend's settings measured on your own chunks: ``kvrag calibrate`` and its API.

``calibrate(engine, prompts)`` measures blend's candidate settings against full
prefill on sample prompts (``sample_prompts`` over chunks from a file or the
store) and chooses the cheapest that meets the bound; ``recorded`` adds the
choice to the model's ``Calibration``, which ``engine.calibrations.save`` keeps in
the store for every engine and vLLM replica serving the model
(``engine.blend_settings``).
"""

from kvrag_integrations.calibration.run import (
    AGREEMENT,
    BOUND,
    RATIOS,
    RECOMPUTE_FIRST,
    SELECTIONS,
    calibrate,
    families,
    recorded,
)
from kvrag_integrations.calibration.samples import (
    SamplePrompt,
    chunks_from_file,
    chunks_from_store,
    prompts_from_items,
    question_about,
    sample_prompts,
    trimmed,
)

__all__ = [
    "AGREEMENT",
    "BOUND",
    "RATIOS",
    "RECOMPUTE_FIRST",
    "SELECTIONS",
    "SamplePrompt",
    "calibrate",
    "chunks_from_file",
    "chunks_from_store",
    "families",
    "prompts_from_items",
    "question_about",
    "recorded",
    "sample_prompts",
    "trimmed",
]
