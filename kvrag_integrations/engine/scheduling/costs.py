"""What forwards cost on these weights, measured as they run: the miss policy's estimates.

``on_miss="auto"`` compares, for a prompt with uncached chunks, encoding them
(each chunk attends only to itself) plus the reuse strategy's own forward
against one full prefill of the prompt. The answer depends on the machine: on
a GPU at long prompts full prefill's attention (quadratic in the prompt) makes
chunk-local encoding cheaper; on a CPU at RAG prompt lengths it is dearer. So
nothing here is a constant tuned for one machine: every request's forwards are
timed (under the forward lock, lock waits excluded) and fitted to one cost
model of a forward::

    seconds = a * computed + b * pairs + d * assembled + c

``computed``: tokens run through the model (the weights' matmuls); ``pairs``:
query-key pairs attended (quadratic: ``n(n+1)/2`` for a full prefill of ``n``
tokens, ``B*L(L+1)/2`` for ``B`` chunks of ``L`` tokens encoded alone, about
``q*n`` for a reuse forward computing ``q`` tokens of an ``n``-token prompt);
``assembled``: cached tokens laid into the prompt cache (moved, rotated);
``c``: per forward. Full prefill, chunk encoding and turbo are fitted
together: they are the same model's forwards, so each keeps the others'
estimates current, and the comparison between them stays consistent when the
machine's load changes. Other reuse strategies (blend's two passes) get a fit
of their own on the same terms.

A fit keeps the recent forwards (64), weighs them by age (half-life 16), fits
relative errors (a 20 ms and a 2 s forward count alike) with Huber weights (a
forward slowed by a burst of load does not drag the estimate), keeps the
coefficients non-negative and picks the subset of terms by BIC, so one
observed length gives a per-token cost and more lengths give the curve. The
first forward of each kind in a process is not fitted: it pays one-time costs
(allocations, kernel selection). Before the forwards a decision needs have
been measured there is no estimate, and the policy uses its prior
(``prior_encodes``): encode on CUDA, where chunk-local encoding is the cheaper
path at any real prompt length; defer on CPU, where it measured 1.06x a full
prefill at 3k tokens and more at shorter prompts. Background encodings are
not measured (fewer threads, paused for requests).
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

_SCALE = 1024.0  # tokens per unit: keeps the least squares well conditioned


class ForwardFit:
    """Recent forwards' seconds fitted to non-negative terms, robustly (see the module).

    Args:
        n_features: the length of every ``features`` vector (per-token term first:
            on ties, fewer terms win, then the earlier ones).
        window: forwards kept.
        half_life: forwards after which an observation weighs half.
    """

    def __init__(self, n_features: int, window: int = 64, half_life: float = 16.0) -> None:
        self.n_features = n_features
        self.half_life = half_life
        self.count = 0
        self._obs: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._coef: np.ndarray | None = None

    def add(self, features: Sequence[float], seconds: float) -> None:
        """Record one forward (non-positive times are ignored)."""
        if seconds > 0:
            self._obs.append((np.asarray(features, dtype=float), float(seconds)))
            self.count += 1
            self._coef = None

    def predict(self, features: Sequence[float]) -> float | None:
        """Estimated seconds, or None before any observation."""
        if not self._obs:
            return None
        if self._coef is None:
            self._coef = self._solve()
        return float(self._coef @ np.asarray(features, dtype=float))

    def _solve(self) -> np.ndarray:
        x = np.stack([f for f, _ in self._obs])
        y = np.array([t for _, t in self._obs])
        weight = 0.5 ** (np.arange(len(y))[::-1] / self.half_life)
        rel = x / y[:, None]  # relative errors: rel @ coef should be 1
        n = float(weight.sum())
        best, best_score = np.zeros(self.n_features), math.inf
        for size in range(1, self.n_features + 1):
            for subset in itertools.combinations(range(self.n_features), size):
                idx = list(subset)
                fitted = _robust_fit(rel[:, idx], weight)
                if fitted is None:
                    continue
                coef, rss = fitted
                score = n * math.log(rss / n + 1e-8) + size * math.log(n + 1)
                if score < best_score - 1e-9:  # ties: the earlier (fewer terms) wins
                    best_score, best = score, np.zeros(self.n_features)
                    best[idx] = coef
        return best


def _robust_fit(a: np.ndarray, weight: np.ndarray) -> tuple[np.ndarray, float] | None:
    """Weighted least squares of ``a @ coef = 1`` with Huber reweighting, and its
    weighted residual; None if a coefficient is negative (those terms do not fit)."""
    huber = np.ones(len(weight))
    coef = np.zeros(a.shape[1])
    for _ in range(4):
        w = np.sqrt(weight * huber)
        coef = np.linalg.lstsq(a * w[:, None], w, rcond=None)[0]
        if not np.all(np.isfinite(coef)) or np.any(coef < 0):
            return None
        resid = a @ coef - 1.0
        scale = max(1.4826 * float(np.median(np.abs(resid))), 0.02)
        huber = np.minimum(1.0, 1.345 * scale / np.maximum(np.abs(resid), 1e-12))
    resid = a @ coef - 1.0
    return coef, float(np.sum(weight * huber * resid * resid))


def _features(computed: float, pairs: float, assembled: float) -> list[float]:
    """computed, pairs, assembled, per forward (units of 1024 tokens, 1024^2 pairs)."""
    return [computed / _SCALE, pairs / _SCALE**2, assembled / _SCALE, 1.0]


def prefill_features(batch: int, length: int) -> list[float]:
    """A prefill forward of ``batch`` sequences of ``length`` tokens (full: batch 1)."""
    return _features(batch * length, batch * length * (length + 1) / 2, 0)


def reuse_features(n: int, computed: int) -> list[float]:
    """A reuse forward computing ``computed`` of an ``n``-token prompt's tokens."""
    return _features(computed, computed * n, max(n - computed, 0))


def encode_batches(lengths: Sequence[int], batch_size: int) -> list[tuple[int, int]]:
    """``(chunks, padded length)`` per forward, as ``ChunkCaches`` batches them
    (longest first, ``batch_size`` per forward, right-padded)."""
    order = sorted(lengths, reverse=True)
    step = max(1, batch_size)
    return [(len(order[i : i + step]), order[i]) for i in range(0, len(order), step)]


class CostModel:
    """Measured costs of full prefill, chunk encoding and reuse on one model's weights.

    Shared by every engine on the weights (``LoadedModel.costs``): costs belong
    to the weights and the device, not to a store. Thread-safe.

    Args:
        device: the model's device (picks the prior).

    Attributes:
        forwards: the fit of full prefill, chunk encoding and turbo.
        strategies: the fits of other reuse strategies, by name.
        counts: forwards recorded per kind (``"full"``, ``"encode"``, a strategy's name).
    """

    SHARED = frozenset({"full", "encode", "turbo"})

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.prior_encodes = self.device.type == "cuda"
        self._lock = threading.Lock()
        self.forwards = ForwardFit(4)
        self.strategies: dict[str, ForwardFit] = {}
        self.counts: dict[str, int] = {}

    def _fit(self, kind: str, create: bool = False) -> ForwardFit | None:
        if kind in self.SHARED:
            return self.forwards
        if create:
            return self.strategies.setdefault(kind, ForwardFit(4))
        return self.strategies.get(kind)

    def _record(self, kind: str, features: list[float], seconds: float) -> None:
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if self.counts[kind] > 1:  # the first of a kind is a warm-up
                self._fit(kind, create=True).add(features, seconds)  # type: ignore[union-attr]

    def measured(self, kind: str) -> bool:
        """Whether forwards of ``kind`` have been fitted (beyond the warm-up)."""
        with self._lock:
            return self.counts.get(kind, 0) > 1

    # ------------------------------------------------------------ measuring
    def record_full(self, n: int, seconds: float) -> None:
        """A full prefill of ``n`` tokens took ``seconds``."""
        self._record("full", prefill_features(1, n), seconds)

    def record_encode(self, batch: int, length: int, seconds: float) -> None:
        """One encoding forward of ``batch`` chunks padded to ``length`` tokens."""
        self._record("encode", prefill_features(batch, length), seconds)

    def record_reuse(self, strategy: str, n: int, computed: int, seconds: float) -> None:
        """A reuse strategy's forward over ``n`` tokens, ``computed`` of them computed."""
        self._record(strategy, reuse_features(n, computed), seconds)

    # ------------------------------------------------------------ estimating
    def _predict(self, kind: str, features: list[float]) -> float | None:
        with self._lock:
            fit = self._fit(kind)
            return None if fit is None else fit.predict(features)

    def full_s(self, n: int) -> float | None:
        """Estimated seconds of a full prefill of ``n`` tokens (None: not measured)."""
        return self._predict("full", prefill_features(1, n))

    def encode_s(self, lengths: Sequence[int], batch_size: int = 8) -> float | None:
        """Estimated seconds to encode chunks of ``lengths`` tokens (0 for none)."""
        parts = [
            self._predict("encode", prefill_features(b, n))
            for b, n in encode_batches(lengths, batch_size)
        ]
        return None if any(p is None for p in parts) else float(sum(parts))  # type: ignore[arg-type]

    def reuse_s(self, strategy: str, n: int, computed: int) -> float | None:
        """Estimated seconds of ``strategy``'s forward (None: not measured yet)."""
        if strategy in self.SHARED and not self.measured(strategy):
            return None  # the shared fit knows prefill, not yet this forward's shape
        return self._predict(strategy, reuse_features(n, computed))
