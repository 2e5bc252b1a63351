"""Self-distillation: the student under TurboRAG's mask is trained toward full prefill.

A training sample is a prompt exactly as the engine builds it (chat template,
instruction, chunks, question) followed by an answer. The teacher is the base
model with the ordinary causal mask; the student is the same model with LoRA
(or fully trainable) run with turbo's mask and positions (``train.mask``) in one
forward. The loss is KL(teacher || student) over the logits at the question and
answer tokens, plus an optional cross-entropy on a gold answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvrag_integrations.engine.prompting.segments import TokenizedPrompt, cache_leading_text
from kvrag_integrations.train.mask import TurboLayout, causal_layout, turbo_layout

DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Sample:
    """One teacher-forced sequence and which of its logits are scored.

    Attributes:
        input_ids: int64 ``[tokens]``: prompt then answer.
        layout: turbo's positions and blocks for the student.
        scored: int64 indices whose logits enter the KL: from the first token after
            the last chunk (the question) to the answer's second-to-last token.
        answer_start: index of the first answer token (= prompt length).
        gold: whether the answer is a gold answer (cross-entropy applies).
    """

    input_ids: torch.Tensor
    layout: TurboLayout
    scored: torch.Tensor
    answer_start: int
    gold: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def build_sample(
    prompt: TokenizedPrompt,
    answer_ids: Sequence[int],
    positions: str = "reordered",
    gold: bool = False,
) -> Sample:
    """A sample from the engine's tokenized prompt and an answer's token ids.

    The prompt's leading text is marked cached as the engine does for turbo
    (``cache_leading_text``); that changes nothing in the mask (it starts at 0).
    """
    prompt = cache_leading_text(prompt)
    answer = torch.as_tensor(list(answer_ids), dtype=torch.long)
    ids = torch.cat([prompt.input_ids, answer])
    layout = turbo_layout(prompt, answer_tokens=answer.numel(), positions=positions)
    start = 0
    question_start = 0
    for piece in prompt.pieces:
        start += piece.ids.numel()
        if piece.is_chunk:
            question_start = start
    end = max(question_start + 1, ids.numel() - 1)  # last logits predict past the answer
    scored = torch.arange(question_start, end)
    return Sample(ids, layout, scored, prompt.num_tokens, gold)


def student_logits(lm: Any, sample: Sample, idx: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[len(idx), vocab]`` (float32) of ``lm`` under turbo's mask and positions.

    ``idx`` defaults to ``sample.scored``. Gradients flow when enabled by the caller.
    """
    return _forward(lm, sample.input_ids, sample.layout, sample.scored if idx is None else idx)


def teacher_logits(lm: Any, sample: Sample, idx: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of ``lm`` on the same tokens with the ordinary causal mask (full prefill)."""
    layout = causal_layout(sample.num_tokens)
    with torch.no_grad():
        return _forward(lm, sample.input_ids, layout, sample.scored if idx is None else idx)


def _forward(lm: Any, ids: torch.Tensor, layout: TurboLayout, idx: torch.Tensor) -> torch.Tensor:
    device = next(lm.parameters()).device
    out = lm(
        input_ids=ids.to(device).unsqueeze(0),
        attention_mask=layout.mask(device),
        position_ids=layout.position_ids.to(device).unsqueeze(0),
        logits_to_keep=idx.to(device),
        use_cache=False,
    )
    return out.logits[0].float()


def kl_loss(teacher: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """Mean over rows of KL(teacher || student) of ``[rows, vocab]`` logits, in nats.

    Examples:
        >>> t = torch.tensor([[1.0, 2.0, 0.5]])
        >>> float(kl_loss(t, t))
        0.0
    """
    log_p = F.log_softmax(teacher.float(), dim=-1)
    log_q = F.log_softmax(student.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


def sample_loss(
    student: Any,
    teacher: Callable[[], AbstractContextManager[Any]],
    sample: Sample,
    ce_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL(teacher || student) on the scored logits, plus ``ce_weight`` x CE on a gold answer.

    Args:
        student: the trainable model.
        teacher: a context manager factory yielding the frozen base model (for LoRA:
            the student with its adapter disabled).
        sample: the sequence.
        ce_weight: weight of the cross-entropy on the answer tokens (gold answers only).

    Returns:
        ``(loss, parts)`` with the loss tensor (differentiable) and its float parts.
    """
    with teacher() as base:
        target = teacher_logits(base, sample)
    logits = student_logits(student, sample)
    kl = kl_loss(target, logits)
    parts = {"kl": float(kl.detach())}
    loss = kl
    if ce_weight > 0 and sample.gold and sample.num_tokens > sample.answer_start:
        # Rows of `scored` at indices answer_start-1 .. n-2 predict the answer tokens.
        first = sample.answer_start - 1 - int(sample.scored[0])
        rows = logits[first:]
        labels = sample.input_ids[sample.answer_start :].to(rows.device)[: rows.shape[0]]
        ce = F.cross_entropy(rows[: labels.numel()], labels)
        parts["ce"] = float(ce.detach())
        loss = loss + ce_weight * ce
    return loss, parts


def add_lora(
    lm: Any, rank: int = 16, alpha: int = 32, targets: Sequence[str] = DEFAULT_LORA_TARGETS
) -> Any:
    """Wrap ``lm`` (in place) with fresh LoRA adapters through ``peft``; return the PeftModel.

    Dropout is 0, so a step is a deterministic function of the weights and data.
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:  # pragma: no cover - optional dependency
        raise ImportError("training needs 'peft': pip install 'kvrag-integrations[train]'") from exc
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=list(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(lm, config)
