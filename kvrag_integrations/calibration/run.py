"""A calibration: blend's candidate settings measured against full prefill, the cheapest kept.

On each sample prompt full prefill's answer is the reference: its first token's
distribution and its greedy answer (a few tokens). Turbo, as the engine serves
it, is the baseline: its mean first-token KL to the reference, and its answers'
agreement with full's (token F1). Each candidate ``BlendSettings`` (an encoding
context, a selection, EPIC's chunk starts, and a recompute ratio) is measured
the same way, with its time to first token as a share of full's and its cost:
the share of the prompt's tokens it computes (the rows it recomputes, and for
deviation-driven selection every row through the first two layers), which is
the machine's load-free measure of what it costs. A candidate meets the bound
where its mean KL is at most ``bound`` x turbo's with confidence (the upper end
of the paired bootstrap's 90% interval of the ratio, over the sample's prompts:
a choice that only just meets it on a dozen prompts misses it on the next
dozen) and its answers agree with full's at least ``agreement`` more than
turbo's do (what blend is for: answers closer to full prefill's). Within a
family (all but the ratio), ratios are tried from the smallest up and the first
that meets the bound ends the family:
more recompute costs more. Of the settings that meet the bound the cheapest is
chosen (ties: the engine's own encoding context, which needs no entries of its
own, then the lower KL); if none does, the one with the lowest KL, marked as
not meeting it.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import product
from typing import Any

from kvrag_integrations.bench.metrics import kl_divergence, paired_bootstrap, token_f1
from kvrag_integrations.calibration.samples import SamplePrompt
from kvrag_integrations.engine.blend_settings import (
    BlendSettings,
    CalibratedChoice,
    Calibration,
    median_chunk_tokens,
)
from kvrag_integrations.engine.prompting.segments import CHUNK_CONTEXTS
from kvrag_integrations.errors import CalibrationError

logger = logging.getLogger(__name__)

RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
SELECTIONS = ("deviation", "query")
RECOMPUTE_FIRST = (0, 4)
BOUND = 0.5  # blend's first-token KL at most this multiple of turbo's (90% confident)
LEVEL = 0.9  # the bootstrap interval whose upper end must meet the bound
AGREEMENT = 0.05  # ... and its answers' F1 against full's at least this above turbo's
ANSWER_TOKENS = 12  # the greedy answer compared (a short answer's length)


@dataclass
class Measured:
    """One candidate's figures on the sample."""

    settings: BlendSettings
    kl: float
    f1: float  # its answers' token F1 against full's, mean
    time_share: float
    cost: float  # the share of the prompt's tokens it computes, mean
    kl_per_prompt: list[float] = field(repr=False)
    kl_ratio_high: float = 0.0  # the upper end of its KL ratio's interval to turbo's

    def meets(self, baseline: Baseline, bound: float, agreement: float) -> bool:
        return self.kl_ratio_high <= bound and self.f1 >= baseline.f1 + agreement

    def row(self, baseline: Baseline) -> dict[str, Any]:
        return {
            "settings": self.settings.as_json(),
            "kl": round(self.kl, 6),
            "kl_ratio": round(self.kl / baseline.kl, 4) if baseline.kl > 0 else None,
            "kl_ratio_high": round(self.kl_ratio_high, 4),
            "f1_vs_full": round(self.f1, 4),
            "time_share": round(self.time_share, 4),
            "cost": round(self.cost, 4),
        }


@dataclass(frozen=True)
class Baseline:
    """Turbo's figures on the sample: mean first-token KL, answers' F1 against full's."""

    kl: float
    f1: float
    kl_per_prompt: list[float]


def families(
    contexts: Sequence[str] = CHUNK_CONTEXTS,
    selections: Sequence[str] = SELECTIONS,
    firsts: Sequence[int] = RECOMPUTE_FIRST,
) -> list[tuple[str, str, int]]:
    """The candidate families: every context, selection and chunk-start count."""
    return list(product(contexts, selections, firsts))


def calibrate(
    engine: Any,
    prompts: Sequence[SamplePrompt],
    *,
    bound: float = BOUND,
    agreement: float = AGREEMENT,
    ratios: Sequence[float] = RATIOS,
    candidate_families: Sequence[tuple[str, str, int]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[CalibratedChoice, list[dict[str, Any]]]:
    """Measure the candidates on ``prompts`` with ``engine`` (a ``KVRAGEngine``) and
    choose (see the module docstring).

    Returns:
        The choice, and every candidate measured (rows for a table).

    Raises:
        CalibrationError: no prompts, or turbo equals full prefill on all of them
            (nothing to calibrate against).
    """
    if not prompts:
        raise CalibrationError("a calibration needs sample prompts")
    say = progress or (lambda line: logger.info("%s", line))
    chunks = list(dict.fromkeys(c for p in prompts for c in p.chunks))
    contexts = sorted({f[0] for f in candidate_families or families()})
    engine.use_strategy("blend")
    engine.caches.encode(chunks, show_progress=False, contexts=contexts)
    full = _measure(engine, prompts, "full", {})
    turbo = _measure(engine, prompts, "turbo", {})
    baseline = Baseline(*_against(full, turbo))
    say(
        f"full prefill {statistics.median(full.seconds) * 1000:.0f} ms; turbo: KL "
        f"{baseline.kl:.4f}, answers' F1 against full's {baseline.f1:.2f}"
    )
    if baseline.kl <= 0:
        raise CalibrationError("turbo equals full prefill on every sample prompt")
    measured: list[Measured] = []
    for context, selection, first in candidate_families or families():
        for ratio in sorted(ratios):
            settings = BlendSettings(context, selection, ratio, first)
            blend = _measure(engine, prompts, "blend", settings.strategy_options())
            kl, f1, kls = _against(full, blend)
            share = statistics.median(s / f for s, f in zip(blend.seconds, full.seconds))
            passes = 2 / engine.loaded.layout.num_layers if selection == "deviation" else 0.0
            cost = statistics.mean(blend.computed) + passes
            high = paired_bootstrap(kls, baseline.kl_per_prompt, level=LEVEL)[2]
            found = Measured(settings, kl, f1, share, cost, kls, high)
            measured.append(found)
            say(
                f"{settings.label}: KL {kl:.4f} ({kl / baseline.kl:.2f}x turbo's, at most "
                f"{high:.2f}x at {LEVEL:.0%}), F1 "
                f"{f1:.2f} ({f1 - baseline.f1:+.2f}), computes {cost:.2f} of the prompt, "
                f"{share:.2f} of full's time"
            )
            if found.meets(baseline, bound, agreement):
                break
    meets = partial(Measured.meets, baseline=baseline, bound=bound, agreement=agreement)
    own = engine.caches.context
    best = _best(measured, meets, own)
    by_context = [_best([m for m in measured if m.settings.chunk_context == c], meets, own)
                  for c in contexts]  # fmt: skip
    meeting = meets(best)
    if not meeting:
        say(
            f"no candidate met the bound ({bound}x turbo's KL, answers +{agreement} F1); "
            "the closest is kept"
        )
    lengths = [median_chunk_tokens(engine.tokenize(_segments(engine, p))) for p in prompts]
    choice = CalibratedChoice(
        chunk_tokens=max(1, round(statistics.median(lengths))),
        settings=best.settings,
        blend_kl=best.kl,
        turbo_kl=baseline.kl,
        time_share=best.time_share,
        prompts=len(prompts),
        bound_met=meeting,
        by_context=tuple(m.settings for m in by_context if m is not None),
        blend_f1=best.f1,
        turbo_f1=baseline.f1,
        cost=best.cost,
    )
    return choice, [m.row(baseline) for m in measured]


def _best(
    measured: Sequence[Measured], meets: Callable[[Measured], bool], own: str
) -> Measured | None:
    """The cheapest of those that meet the bound (ties, within a hundredth of the
    prompt: the engine's own context ``own``, then the lower KL), else the one with
    the lowest KL (None: none measured)."""
    meeting = [m for m in measured if meets(m)]
    if meeting:
        return min(meeting, key=lambda m: (round(m.cost, 2), m.settings.chunk_context != own, m.kl))
    return min(measured, key=lambda m: m.kl) if measured else None


def recorded(
    engine: Any, choice: CalibratedChoice, rows: list[dict[str, Any]], bound: float, sample: str
) -> Calibration:
    """The engine's calibration with ``choice`` added (replacing one of the same
    chunk length), its measurements kept in ``details``."""
    current = engine.calibrations.current()
    identity = engine.calibrations.identity
    if current is None or current.identity != identity:
        current = Calibration(identity, engine.loaded.name, (), bound)
    details = dict(current.details)
    details[str(choice.chunk_tokens)] = {"sample": sample, "candidates": rows}
    calibration = current.with_choice(choice)
    return Calibration(identity, engine.loaded.name, calibration.choices, bound, details)


def _segments(engine: Any, prompt: SamplePrompt) -> list[Any]:
    return engine.build_segments(question=prompt.question, chunks=list(prompt.chunks))


@dataclass
class _Answers:
    """Each prompt's first-token logits, greedy answer and time to first token."""

    logits: list[Any]
    texts: list[str]
    seconds: list[float]
    computed: list[float]  # the share of each prompt's tokens recomputed


def _measure(
    engine: Any, prompts: Sequence[SamplePrompt], strategy: str, options: dict[str, Any]
) -> _Answers:
    answers = _Answers([], [], [], [])
    for prompt in prompts:
        result = engine.generate(
            question=prompt.question,
            chunks=list(prompt.chunks),
            strategy=strategy,
            on_miss="encode",
            max_new_tokens=ANSWER_TOKENS,
            stop=["\n"],
            **options,
        )
        answers.logits.append(result.first_token_logits.detach().float().cpu())
        answers.texts.append(result.text)
        answers.seconds.append(result.ttft_s)
        answers.computed.append(result.recomputed_tokens / max(1, result.prompt_tokens))
    return answers


def _against(full: _Answers, other: _Answers) -> tuple[float, float, list[float]]:
    """``other``'s mean first-token KL to ``full``'s, its answers' mean F1 against
    full's, and each prompt's KL."""
    kls = [kl_divergence(r, o) for r, o in zip(full.logits, other.logits)]
    f1 = statistics.mean(token_f1(o, r) for r, o in zip(full.texts, other.texts))
    return statistics.mean(kls), f1, kls
