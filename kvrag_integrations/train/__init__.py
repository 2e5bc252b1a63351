"""TurboRAG fine-tuning by self-distillation (``kvrag train``).

The student sees each prompt with TurboRAG's mask and positions (``mask``); the
teacher is the base model's ordinary full prefill (``distill``); the trainer
(``trainer``) fits LoRA adapters through ``peft`` and saves them as safetensors
for ``KVRAGEngine.from_pretrained(adapter=...)``. ``eval`` measures held-out items.
"""

from kvrag_integrations.train.data import RagExample, load_corpus, split
from kvrag_integrations.train.mask import TurboLayout, block_mask, turbo_layout
from kvrag_integrations.train.trainer import TrainConfig, Trainer, TrainResult, train

__all__ = [
    "RagExample",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TurboLayout",
    "block_mask",
    "load_corpus",
    "split",
    "train",
    "turbo_layout",
]
