"""Finding stored passages in a plain client's prompt: what the server loads, and learns.

A client that only points an OpenAI SDK at the server sends text; vLLM renders
and tokenizes it as a whole. ``Detector.detect`` reads those token ids, asks
the content index (``matching``) for the runs of them that also occur inside
stored entries (chunks ingested through the server, prompts and glue learned
from earlier requests), and plans the load a ``VLLMEngine`` client would have
asked for: the prompt's leading run of stored pieces, each read from inside its
entry where it sits there (``PieceSpec.lead``), its keys moved to where it sits
now. The run stops at the first text that is in no entry; vLLM computes the rest.

What is read is always verified: a run's ids were compared with the entry's own
(never a hash alone), the connector keys each piece by its entry's ids in the
request's namespace, and the store checks the entry's integrity code and key.
Rows read from inside an entry saw the entry's ids before them: they are used
only where this prompt holds that text too (``_ContextCheck``), so no stored
prompt can carry text another request never sent into its answer.
Loading rows of an entry at another position, after other text, is TurboRAG's
approximation (a passage encoded in another context, keys re-rotated).

What it learns (``Detection.learn_prompt``, ``Detection.learn``): a request that
would reuse little runs exactly and stores its whole prompt as one entry (exact:
computed from position 0, loading nothing), so its passages, head and glue are
found in the next request that shows them, in any order. Short glue between
found passages that is stored nowhere (``Detection.glue``) is encoded on its own
(as a chunk is: a step of a few tokens) before the request is planned again; a
long unknown remainder after the loaded run is encoded in the background.

A longer unknown text before the first found passages (an agent's new question
and tool call, ahead of the passages its tool returned: ``Detection.prefix``)
would stop the load at position 0, since vLLM's external tokens are a prefix of
the prompt. The prompt's whole prefix up to those passages is then computed
exactly first and stored, and the request is planned again with it as its first
piece: in a tenant's own namespace as learned glue (found by the index like any
entry); for a caller that may not teach the shared namespace, as a private
entry (``detect(prefix=...)``; ``reuse_hook`` stores it under ids only that
request knows, unindexed, and drops it after the request).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.matching import ContentIndex
from kvrag_integrations.vllm.params import PieceSpec

MAX_GLUE_TOKENS = 32  # text between two found passages that is looked up (and learned) as glue
# A longer unknown text before the first found passages (a new question and an agent's
# tool call ahead of the tool's passages) is no glue: the prompt's prefix up to them, at
# most this long, is computed exactly and stored first (``Detection.prefix``), where at
# least MIN_PREFIX_GAIN found tokens follow it (what its encode buys).
MAX_PREFIX_TOKENS = 1024
MIN_PREFIX_GAIN = 64
MIN_SHARE = 0.5  # a request that would load less than this share runs exactly and is learned
LEARN_MIN_TOKENS = 256  # shorter prompts (and remainders) are not worth an entry
MAX_LEARN_PER_REQUEST = 8  # background encodes one request may start
MAX_FOREIGN_TOKENS = 4  # what rows read from inside an entry may have attended to unseen


class RunLike(Protocol):
    start: int
    length: int
    entry: tuple[int, ...]
    offset: int


class RunIndex(Protocol):
    """The content index the detector reads (``matching.SyncedIndex``)."""

    def cover(
        self,
        namespace: str,
        prompt: Sequence[int],
        accept: Callable[[tuple[int, ...], int], bool] | None = None,
    ) -> Sequence[RunLike]: ...

    def remove(self, namespace: str, ids: Sequence[int]) -> bool: ...


@dataclass(frozen=True)
class Detection:
    """What the server does with one request.

    Attributes:
        load: the leading run of stored pieces to load (empty: load nothing).
        learn_prompt: store the whole prompt as one entry (the request then loads
            nothing and is computed exactly).
        learn: id spans to encode on their own in the background (a long unknown
            remainder after the load).
        glue: short text between found passages that no entry holds yet: encoded
            on its own (a step of a few tokens), the request is planned again
            (where the request may teach its namespace, also the prompt's prefix
            up to ``prefix``).
        reason: why the load stops where it does (logged).
        prefix: where the found passages after a longer unknown text at the
            prompt's start begin (0: none such): the prompt's prefix up to there,
            computed exactly and stored first, lets them load.
    """

    load: tuple[PieceSpec, ...] = ()
    learn_prompt: bool = False
    learn: tuple[tuple[int, ...], ...] = ()
    glue: tuple[tuple[int, ...], ...] = ()
    reason: str = ""
    prefix: int = 0

    @property
    def load_end(self) -> int:
        return self.load[-1].end if self.load else 0


@dataclass
class Detector:
    """Plans a request's load from the content index (see the module docstring).

    Args:
        index: the content index of stored entries.
        contains: the store's existence check (by key).
        base_fingerprint: the connector's storage fingerprint (rank 0); a tenant's
            entries are keyed under ``Tenant.fingerprint(base_fingerprint)``.
        max_entry_tokens: the longest prompt stored as an entry.
        learn_min_tokens: shorter prompts and remainders are not learned (0: the
            server learns nothing; it still finds what was ingested).
    """

    index: RunIndex
    contains: Callable[[str], bool]
    base_fingerprint: str
    max_entry_tokens: int = 4096
    learn_min_tokens: int = LEARN_MIN_TOKENS
    max_glue_tokens: int = MAX_GLUE_TOKENS
    max_prefix_tokens: int = MAX_PREFIX_TOKENS
    min_share: float = MIN_SHARE
    _known: dict[str, bool] = field(default_factory=dict, repr=False)

    def detect(
        self,
        fingerprint: str,
        prompt: Sequence[int],
        may_learn: bool,
        fresh_glue: bool = False,
        prefix: PieceSpec | None = None,
    ) -> Detection:
        """The plan for ``prompt`` in the namespace of ``fingerprint`` (the tenant's
        storage fingerprint); ``may_learn``: the server may store what the caller
        sent (its prompt, remainder, and the glue no entry holds yet, the prompt's
        unknown prefix before found passages among it).

        ``fresh_glue``: every glue between found passages is to be encoded, stored
        or not (``Detection.glue``), though nothing else is learned: in the shared
        namespace, a request then takes the same course whatever others sent
        before it (a glue stored already is encoded again, and saved no twice).

        ``prefix``: the prompt's first piece, stored for this request alone (its
        private entry of the ids before ``Detection.prefix``): the run goes on
        from its end."""
        self._known.clear()  # existence is asked afresh for each request
        prompt = list(prompt)
        runs = self._stored_runs(fingerprint, prompt)
        learnable = 0 < self.learn_min_tokens <= len(prompt) <= self.max_entry_tokens
        learn_prompt = may_learn and learnable
        if not runs and prefix is None:
            reason = "no stored passage in the prompt"
            return Detection(learn_prompt=learn_prompt, reason=reason)
        pieces, glue, end, reason, head = self._run(fingerprint, prompt, runs, fresh_glue, prefix)
        if head and may_learn:
            glue.insert(0, tuple(prompt[:head]))  # the exact prefix, first
        learns_glue = may_learn or fresh_glue
        unknown_glue = tuple(dict.fromkeys(glue))[:MAX_LEARN_PER_REQUEST] if learns_glue else ()
        if end < self.min_share * len(prompt) and learn_prompt:
            # Little to reuse: computing it all costs about as much, and the whole
            # prompt stored makes every passage in it reusable in any order next time.
            return Detection(
                learn_prompt=True,
                glue=unknown_glue,
                reason=f"{reason}; only {end} of {len(prompt)} tokens reusable: computed "
                "and stored whole",
                prefix=head,
            )
        learn = []
        rest = len(prompt) - end
        if may_learn and self.learn_min_tokens and self.learn_min_tokens <= rest:
            span = tuple(prompt[end : end + self.max_entry_tokens])
            if not self._stored(fingerprint, span):
                learn.append(span)
        return Detection(tuple(pieces), False, tuple(learn), unknown_glue, reason, head)

    def _stored_runs(self, fingerprint: str, prompt: list[int]) -> list[RunLike]:
        """The index's cover of ``prompt`` by runs whose context it holds
        (``_ContextCheck``), without entries the store has lost since they were
        indexed (they are forgotten, and the cover is asked again)."""
        held = _ContextCheck(prompt)
        for _ in range(3):
            runs = list(self.index.cover(fingerprint, prompt, held))
            gone = {r.entry for r in runs if not self._stored(fingerprint, r.entry)}
            if not gone:
                return runs
            for ids in gone:
                self.index.remove(fingerprint, ids)
        return []

    def _run(
        self,
        fingerprint: str,
        prompt: list[int],
        runs: Sequence[RunLike],
        fresh_glue: bool,
        prefix: PieceSpec | None,
    ) -> tuple[list[PieceSpec], list[tuple[int, ...]], int, str, int]:
        """The leading run of pieces (found passages, stored glue between them),
        the unknown glue seen anywhere, where the run ends, why, and where found
        passages after a longer unknown prefix begin (0: none, or too few)."""
        pieces: list[PieceSpec] = [prefix] if prefix is not None else []
        glue: list[tuple[int, ...]] = []
        position, stop = (prefix.end if prefix is not None else 0), ""
        head, gain, counting = 0, 0, False  # the unknown prefix's end; found after it
        for run in runs:
            if run.start < position:  # (inside the prefix: its own entry holds it)
                if run.start + run.length <= position:
                    continue
                cut = position - run.start
                run = _Run(position, run.length - cut, run.entry, run.offset + cut)
            if run.start > position:
                gap = tuple(prompt[position : run.start])
                if len(gap) > self.max_glue_tokens:
                    if not stop and prefix is None and run.start <= self.max_prefix_tokens:
                        head, counting = run.start, True
                    elif counting:
                        counting = False  # what loads after the prefix ends here
                    stop = stop or f"{len(gap)} unknown tokens at {position}"
                elif not fresh_glue and self._stored(fingerprint, gap):
                    if not stop:
                        pieces.append(PieceSpec(position, len(gap)))
                else:
                    glue.append(gap)
                    stop = stop or f"glue of {len(gap)} tokens at {position} not stored yet"
            if not stop:
                lead = run.entry[: run.offset]
                tail = run.entry[run.offset + run.length :]
                pieces.append(PieceSpec(run.start, run.length, tuple(tail), tuple(lead)))
            gain += run.length if counting else 0
            position = run.start + run.length
        end = pieces[-1].end if pieces else 0
        if not stop:
            stop = "the prompt's unknown remainder" if end < len(prompt) else "all stored"
        head = head if gain >= MIN_PREFIX_GAIN else 0
        return pieces, glue, end, stop, head

    def _stored(self, fingerprint: str, ids: Sequence[int]) -> bool:
        key = cache_key(fingerprint, list(ids))
        if key not in self._known:
            self._known[key] = bool(self.contains(key))
        return self._known[key]


@dataclass(frozen=True)
class _Run:
    """A found run cut where the request's own prefix piece ends."""

    start: int
    length: int
    entry: tuple[int, ...]
    offset: int


class _ContextCheck:
    """Whether rows read from inside an entry saw only text this prompt holds too.

    A stored row's K/V carry what it attended to: the entry's ids before it. A
    passage found inside a stored prompt after other text (an instruction, an
    injection) would bring that text's influence into a request that never sent
    it. A run that starts inside an entry is used only where the entry's ids
    before it are runs of this prompt too (in any order: the same passages
    retrieved again), but for ``MAX_FOREIGN_TOKENS`` (edge tokens merged
    differently).
    """

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt
        self.index: ContentIndex | None = None
        self.seen: dict[tuple[int, int], bool] = {}

    def __call__(self, entry: tuple[int, ...], offset: int) -> bool:
        if offset <= MAX_FOREIGN_TOKENS:
            return True
        key = (id(entry), offset)
        if key not in self.seen:
            if self.index is None:
                self.index = ContentIndex()
                self.index.add("prompt", self.prompt)
            lead = entry[:offset]
            held = sum(r.length for r in self.index.cover("prompt", lead))
            self.seen[key] = len(lead) - held <= MAX_FOREIGN_TOKENS
        return self.seen[key]
