"""The training loop: teacher answers, AdamW, accumulation, checkpoints, resume.

Everything is a function of the config and the corpus: the data order comes from
the seed, LoRA's initialisation from the seed, and there is no dropout, so a run
resumed from a checkpoint ends with the same weights as one that never stopped.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvrag_integrations.engine.engine import KVRAGEngine
from kvrag_integrations.engine.modeling.model import LoadedModel, load_model
from kvrag_integrations.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from kvrag_integrations.train.data import RagExample, load_corpus, prompt_chunks, split
from kvrag_integrations.train.distill import (
    DEFAULT_LORA_TARGETS,
    Sample,
    add_lora,
    build_sample,
    sample_loss,
)

logger = logging.getLogger(__name__)

ANSWERS_FILE = "teacher_answers.json"


@dataclass
class TrainConfig:
    """What a run depends on (saved next to the adapter as ``train_config.json``).

    Attributes:
        out: output folder (adapter, checkpoints, teacher answers).
        model: base model (HF id, folder, ``.gguf``; None = bundled SmolLM2).
        corpus: JSON file or folder (see ``train.data``); None = ../shared MuSiQue.
        max_steps: optimizer steps.
        lr: AdamW learning rate (after a linear warm-up of ``warmup_steps``).
        grad_accum: samples per optimizer step.
        full: train every weight instead of LoRA (small models only).
        answers: ``"teacher"`` (base model's greedy answer) or ``"gold"``.
        ce_weight: cross-entropy weight on gold answers (``answers="gold"``).
        heldout_fraction: share of items (by id hash) never trained on.
    """

    out: str = "turbo-adapter"
    model: str | None = None
    corpus: str | None = None
    max_steps: int = 300
    lr: float = 2e-4
    seed: int = 0
    grad_accum: int = 1
    warmup_steps: int = 10
    weight_decay: float = 0.0
    full: bool = False
    lora_rank: int = 16
    lora_alpha: int = 32
    lora_targets: list[str] = field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    n_chunks: int = 3
    chunk_tokens: int = 120
    max_answer_tokens: int = 16
    answers: str = "teacher"
    ce_weight: float = 0.0
    positions: str = "reordered"
    heldout_fraction: float = 0.2
    save_every: int = 50
    device: str = "auto"
    dtype: str | None = None
    progress: bool = True


@dataclass
class TrainResult:
    """Where the adapter went and how the loss moved."""

    out: Path
    steps: int
    losses: list[float]
    seconds: float


def schedule(n_items: int, seed: int, index: int, variants: int) -> tuple[int, int]:
    """``(item, variant)`` of the ``index``-th sample: a seeded shuffle per epoch.

    Examples:
        >>> schedule(4, 0, 5, 3) == schedule(4, 0, 5, 3)
        True
    """
    epoch, offset = divmod(index, n_items)
    order = list(range(n_items))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[offset], epoch % max(1, variants)


class Trainer:
    """Distils turbo-masked prompts into LoRA (or all) weights of a base model.

    Args:
        config: the run's settings.
        examples: training items (default: the corpus minus the held-out split).
        loaded: an already loaded base model to train (it is modified in place).
    """

    def __init__(
        self,
        config: TrainConfig,
        examples: list[RagExample] | None = None,
        loaded: LoadedModel | None = None,
    ) -> None:
        self.config = config
        self.out = Path(config.out)
        if examples is None:
            corpus = config.corpus or str(Path("..") / "shared" / "data" / "musique_dev.json")
            examples, _ = split(load_corpus(corpus), config.heldout_fraction)
        if not examples:
            raise ValueError("no training examples")
        self.examples = examples
        torch.manual_seed(config.seed)
        self.loaded = loaded or load_model(config.model, device=config.device, dtype=config.dtype)
        self.prompts = KVRAGEngine(self.loaded)  # builds prompts exactly as at inference
        self.variants = max(1, min(len(e.passages) for e in examples) // config.n_chunks)
        self.out.mkdir(parents=True, exist_ok=True)
        self.answers = self._teacher_answers()  # before any weight changes
        self.model, self.teacher = self._student()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        self.step = 0
        self.losses: list[float] = []

    # ------------------------------------------------------------ samples
    def _key(self, item: int, variant: int) -> str:
        return f"{self.examples[item].item_id}:{variant}"

    def _needed(self) -> list[tuple[int, int]]:
        total = self.config.max_steps * self.config.grad_accum
        seen = {}
        for i in range(total):
            pair = schedule(len(self.examples), self.config.seed, i, self.variants)
            seen.setdefault(pair, None)
            if len(seen) == len(self.examples) * self.variants:
                break
        return list(seen)

    def _chunks(self, item: int, variant: int) -> list[str]:
        cfg = self.config
        tok = self.loaded.tokenizer
        return prompt_chunks(tok, self.examples[item], cfg.n_chunks, cfg.chunk_tokens, variant)

    def _teacher_answers(self) -> dict[str, list[int]]:
        """Greedy answers of the base model (full prefill), cached in the output folder."""
        path = self.out / ANSWERS_FILE
        cached = json.loads(path.read_text()) if path.is_file() else {}
        if self.config.answers == "gold":
            return cached
        todo = [pair for pair in self._needed() if self._key(*pair) not in cached]
        eos = self.prompts.eos_token_ids
        bar = tqdm(todo, desc="Teacher answers", disable=not self.config.progress or not todo)
        for item, variant in bar:
            result = self.prompts.generate(
                question=self.examples[item].question,
                chunks=self._chunks(item, variant),
                strategy="full",
                max_new_tokens=self.config.max_answer_tokens,
            )
            ids = list(result.token_ids)
            if result.finish_reason == "stop" and eos:
                ids.append(eos[0])
            cached[self._key(item, variant)] = ids
        path.write_text(json.dumps(cached))
        return cached

    def sample(self, index: int) -> Sample:
        """The ``index``-th training sample of the run."""
        item, variant = schedule(len(self.examples), self.config.seed, index, self.variants)
        example = self.examples[item]
        segments = self.prompts.build_segments(
            question=example.question, chunks=self._chunks(item, variant)
        )
        prompt = self.prompts.tokenize(segments)
        gold = self.config.answers == "gold"
        if gold:
            tok = self.loaded.tokenizer
            answer = tok(example.answers[0] if example.answers else "", add_special_tokens=False)
            ids = list(answer["input_ids"]) + self.prompts.eos_token_ids[:1]
        else:
            ids = self.answers[self._key(item, variant)]
        return build_sample(prompt, ids, self.config.positions, gold=gold)

    # ------------------------------------------------------------ models
    def _student(self) -> tuple[Any, Callable[[], AbstractContextManager[Any]]]:
        lm = self.loaded.model
        if self.config.full:
            frozen = copy.deepcopy(lm).eval().requires_grad_(False)
            lm.train().requires_grad_(True)
            return lm, lambda: nullcontext(frozen)
        cfg = self.config
        peft_model = add_lora(lm, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
        peft_model.train()

        @contextmanager
        def base() -> Iterator[Any]:
            with peft_model.disable_adapter():
                yield peft_model

        return peft_model, base

    # ------------------------------------------------------------ loop
    def resume(self) -> int:
        """Load the newest checkpoint under ``out/checkpoints``; return its step (0: none)."""
        path = latest_checkpoint(self.out / "checkpoints")
        if path is None:
            return 0
        state = load_checkpoint(path, self.model, self.optimizer)
        self.step = int(state["step"])
        self.losses = list(state.get("losses", []))
        logger.info("resumed from %s (step %d)", path, self.step)
        return self.step

    def train_step(self) -> float:
        """One optimizer step over ``grad_accum`` samples; returns the mean loss."""
        cfg = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.lr * min(1.0, (self.step + 1) / max(1, cfg.warmup_steps))
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for k in range(cfg.grad_accum):
            sample = self.sample(self.step * cfg.grad_accum + k)
            loss, _ = sample_loss(self.model, self.teacher, sample, cfg.ce_weight)
            (loss / cfg.grad_accum).backward()
            total += float(loss.detach()) / cfg.grad_accum
        self.optimizer.step()
        self.step += 1
        self.losses.append(total)
        return total

    def checkpoint(self) -> Path:
        state = {"step": self.step, "losses": self.losses, "config": asdict(self.config)}
        return save_checkpoint(self.out / "checkpoints", self.model, self.optimizer, state)

    def fit(self, resume: bool = False) -> TrainResult:
        """Train until ``max_steps`` (checkpointing every ``save_every``), then save."""
        started = time.perf_counter()
        if resume:
            self.resume()
        cfg = self.config
        bar = tqdm(
            total=cfg.max_steps, initial=self.step, desc="Training", disable=not cfg.progress
        )
        with bar:
            while self.step < cfg.max_steps:
                loss = self.train_step()
                recent = self.losses[-10:]
                bar.set_postfix(loss=f"{loss:.4f}", avg10=f"{sum(recent) / len(recent):.4f}")
                bar.update(1)
                if cfg.save_every and self.step % cfg.save_every == 0:
                    self.checkpoint()
        if cfg.save_every and self.step % cfg.save_every:
            self.checkpoint()  # so a later --resume with more steps starts here
        self.save(self.out)
        return TrainResult(self.out, self.step, self.losses, time.perf_counter() - started)

    def save(self, folder: str | Path) -> Path:
        """Save the adapter (or the full model and tokenizer) as safetensors."""
        folder = Path(folder)
        self.model.save_pretrained(folder, safe_serialization=True)
        if self.config.full:
            self.loaded.tokenizer.save_pretrained(folder)
        (folder / "train_config.json").write_text(json.dumps(asdict(self.config), indent=1))
        (folder / "losses.json").write_text(json.dumps(self.losses))
        return folder


def train(config: TrainConfig, resume: bool = False) -> TrainResult:
    """Train with ``config`` on its corpus; see ``Trainer``."""
    return Trainer(config).fit(resume=resume)
