"""What a request does about chunks with no stored cache: the ``on_miss`` policies.

A prompt's missing chunks are of three kinds: *new* (nobody is encoding them),
*queued* (an earlier request deferred them to the background worker) and *in
flight* (being encoded now, by the worker or another request). A request either
reuses (it encodes what it must, waits for what is in flight, and assembles the
prompt cache from chunk caches) or answers by a full prefill of the prompt and
leaves the misses to the background worker.

- ``"encode"``: always reuse; new chunks are encoded on the request path.
- ``"defer"``: never encode new chunks on the request path: a prompt with any
  answers by full prefill. Queued and in-flight ones are still taken over when
  that is cheaper (below), since nothing else stands in the way of reuse.
- ``"auto"`` (the default): reuse when its estimated cost is no more than a full
  prefill's, by the costs measured on these weights (``engine.scheduling.costs``); before
  they are measured, the prior: encode on CUDA, defer on CPU.

The estimate of reusing is encoding the new chunks plus the reuse strategy's
forward. Queued and in-flight chunks are owed work: an earlier request already
deferred them, and they are encoded on the same device whether this request
takes them over (or waits for them) or leaves them to the worker, which does
them right after it, on the same cores. So they count on both sides and drop
out: with nothing new to encode, a request takes over whenever the reuse
forward costs no more than a full prefill, which is always but for prompts so
small that one forward's overhead dominates. The second request of a
conversation reuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvrag_integrations.engine.scheduling.costs import CostModel

ON_MISS = ("auto", "defer", "encode")
DEFAULT_ON_MISS = "auto"


def check_on_miss(on_miss: str) -> str:
    """``on_miss`` if it is one of ``ON_MISS``, else ``ValueError``."""
    if on_miss not in ON_MISS:
        raise ValueError(f"on_miss must be one of {ON_MISS}, got {on_miss!r}")
    return on_miss


@dataclass(frozen=True)
class MissPlan:
    """The decision: ``reuse`` (encode, wait, assemble) or full prefill, and why."""

    reuse: bool
    reason: str


@dataclass(frozen=True)
class Misses:
    """Token counts of a prompt's missing chunks by kind (the leading text excluded)."""

    new: Sequence[int] = ()
    queued: Sequence[int] = ()
    in_flight: Sequence[int] = ()

    def __bool__(self) -> bool:
        return bool(self.new or self.queued or self.in_flight)

    def describe(self) -> str:
        kinds = (("new", self.new), ("queued", self.queued), ("in flight", self.in_flight))
        parts = [f"{len(v)} {name}" for name, v in kinds if v]
        return ", ".join(parts) + " chunk(s)"


def decide(
    policy: str,
    misses: Misses,
    costs: CostModel,
    *,
    strategy: str,
    prompt_tokens: int,
    computed_tokens: int,
    can_wait: bool = True,
    batch_size: int = 8,
) -> MissPlan:
    """Reuse or full prefill for a prompt with ``misses`` (see the module doc).

    Args:
        policy: ``"auto"``, ``"defer"`` or ``"encode"``.
        misses: the missing chunks' token counts by kind.
        costs: the measured costs on these weights.
        strategy: the reuse strategy's name (its forward's cost is measured apart).
        prompt_tokens: the prompt's length (what a full prefill computes).
        computed_tokens: tokens the reuse strategy computes (text, recomputed ones).
        can_wait: False when the caller holds the forward lock (an encoding in
            flight could not finish): chunks in flight then mean full prefill.
        batch_size: chunks per encoding forward.
    """
    if not misses:
        return MissPlan(True, "every chunk cached")
    what = misses.describe()
    if misses.in_flight and not can_wait:
        return MissPlan(False, f"{what}: in flight, and the forward lock is held: full prefill")
    if policy == "encode":
        return MissPlan(True, f"{what}: on_miss=encode encodes them on the request path")
    if misses.new and policy == "defer":
        return MissPlan(False, f"{what}: on_miss=defer answers by full prefill")
    full = costs.full_s(prompt_tokens)
    encode = costs.encode_s(misses.new, batch_size)
    reuse = costs.reuse_s(strategy, prompt_tokens, computed_tokens)
    if full is None or encode is None or reuse is None:
        if not misses.new:  # owed work only: a reuse forward is no dearer than full prefill
            return MissPlan(True, f"{what}: taken over (costs not measured yet)")
        device = costs.device.type
        verdict = "encode" if costs.prior_encodes else "defer"
        return MissPlan(
            costs.prior_encodes,
            f"{what}: costs not measured yet; the prior on {device} is to {verdict}",
        )
    sums = f"encode {encode:.3f} s + {strategy} {reuse:.3f} s"
    if misses.queued or misses.in_flight:
        sums += " (queued and in-flight encodings are owed either way)"
    if encode + reuse <= full:
        return MissPlan(True, f"{what}: estimated {sums} <= full prefill {full:.3f} s")
    return MissPlan(False, f"{what}: estimated {sums} > full prefill {full:.3f} s")
