"""Answer and distribution metrics, named as in docs/benchmarks.md."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces.

    Examples:
        >>> normalize_answer("The  Eiffel Tower!")
        'eiffel tower'
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def token_f1(prediction: str, reference: str) -> float:
    """Token-overlap F1 of two answers after ``normalize_answer``.

    Examples:
        >>> round(token_f1("in Paris, France", "Paris"), 2)
        0.5
    """
    pred = normalize_answer(prediction).split()
    ref = normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, references: Iterable[str]) -> float:
    """The best ``token_f1`` against any of the gold answers."""
    return max((token_f1(prediction, r) for r in references), default=0.0)


def kl_divergence(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(reference || other) of two next-token distributions, in nats.

    Examples:
        >>> kl_divergence(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
        0.0
    """
    p = torch.log_softmax(reference_logits.float(), dim=-1)
    q = torch.log_softmax(logits.float(), dim=-1)
    return max(0.0, float((p.exp() * (p - q)).sum()))


@torch.no_grad()
def answer_loglik(lm: Any, kv: Any, first_logits: torch.Tensor, answer_ids: torch.Tensor) -> float:
    """Mean per-token log-probability of ``answer_ids`` teacher-forced after a prompt cache.

    Args:
        lm: the causal LM.
        kv: the prompt cache a strategy built (``PromptKV``); left unchanged.
        first_logits: the logits of the first generated token (the last prompt token's).
        answer_ids: int64 ``[m]`` ids of the gold answer, tokenized alone.

    Returns:
        The mean over the answer's tokens of log p(token | prompt, previous answer tokens).
    """
    from kvrag_integrations.engine.modeling.generate import to_dynamic_cache
    from kvrag_integrations.engine.modeling.hf_compat import cache_argument

    ids = answer_ids.to(lm.device)
    if ids.numel() == 0:
        raise ValueError("the answer has no tokens")
    logps = [torch.log_softmax(first_logits.float(), dim=-1)[ids[0]].reshape(1)]
    if ids.numel() > 1:
        start = kv.next_position
        positions = torch.arange(start, start + ids.numel() - 1, device=lm.device)
        out = lm(
            input_ids=ids[:-1].unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            **cache_argument(lm, to_dynamic_cache(kv)),
            use_cache=True,
        )
        rest = torch.log_softmax(out.logits[0].float(), dim=-1)
        logps.append(rest.gather(1, ids[1:].unsqueeze(1)).squeeze(1))
    return float(torch.cat(logps).mean())


def paired_bootstrap(
    values: list[float],
    baseline: list[float] | None = None,
    *,
    ratio: bool = True,
    resamples: int = 2000,
    level: float = 0.9,
    seed: int = 0,
) -> tuple[float, float, float]:
    """A paired comparison over the same questions, with a bootstrap interval.

    Questions are resampled with replacement, keeping each question's pair
    together (a percentile interval, as ``scipy.stats.bootstrap(..., paired=True,
    method="percentile")`` gives; numpy alone, so the calibration can use it
    without the bench extra), so the interval reflects how much the verdict
    depends on which questions were drawn.

    Args:
        values: one number per question for the strategy under test.
        baseline: the same questions' numbers for the baseline, in the same order;
            None for the interval of ``mean(values)`` alone.
        ratio: True for ``mean(values) / mean(baseline)`` (e.g. KL relative to
            turbo's), False for ``mean(values) - mean(baseline)``. Ignored
            without a baseline.
        resamples: bootstrap resamples.
        level: the central interval's coverage.
        seed: the resampling seed (the interval is reproducible).

    Returns:
        ``(estimate, low, high)``; a single question, or questions that all
        give the same statistic, give ``(estimate, estimate, estimate)``.

    Examples:
        >>> paired_bootstrap([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])[0]
        0.5
        >>> paired_bootstrap([1.0, 2.0], [0.0, 1.0], ratio=False)
        (1.0, 1.0, 1.0)
        >>> paired_bootstrap([0.5, 0.5])
        (0.5, 0.5, 0.5)
    """
    if not values or (baseline is not None and len(values) != len(baseline)):
        raise ValueError("need the same non-empty list of questions on both sides")
    data = [np.asarray(values, dtype=float)]
    if baseline is not None:
        data.append(np.asarray(baseline, dtype=float))

    def statistic(picked: list[np.ndarray]) -> np.ndarray:
        mean = picked[0].mean(axis=-1)
        if len(picked) == 1:
            return mean
        base = picked[1].mean(axis=-1)
        if not ratio:
            return mean - base
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(base != 0, mean / np.where(base != 0, base, 1.0), np.inf)

    estimate = float(statistic(data))
    if len(values) < 2 or all(len(set(d.tolist())) == 1 for d in data):
        return estimate, estimate, estimate  # nothing to resample: no spread
    rows = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values)))
    spread = statistic([d[rows] for d in data])
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(spread, [tail, 100 - tail])
    return estimate, float(low), float(high)


def kl_top(exact: dict[Any, float], approx: dict[Any, float]) -> float:
    """KL(exact || approx) over the exact answer's top tokens (an approximate
    log-probability missing from its own top list counts as its smallest one)."""
    if not exact or not approx:
        return math.nan
    floor = min(approx.values())
    return sum(math.exp(lp) * (lp - approx.get(t, floor)) for t, lp in exact.items())
