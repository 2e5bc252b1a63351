"""Finding stored passages in a plain client's prompt: what the server loads, and learns.

A client that only points an OpenAI SDK at the server sends text; vLLM renders
and tokenizes it as a whole. ``Detector.detect`` reads those token ids, asks
the content index (``matching``) for the runs of them that also occur inside
stored entries (chunks ingested through the server, prompts learned and glue
stored from earlier requests), and plans the load a ``VLLMEngine`` client would have
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

What is stored of what a request sent depends on its admission
(``admission.Admission``):

- **A tenant that keeps** (a key's or a salt's namespace): a request that would
  reuse little runs exactly and its whole prompt is learned as one entry (exact:
  computed from position 0, loading nothing), so its passages, head and glue are
  found in the tenant's next request that shows them, in any order. Short glue
  between found passages that is stored nowhere (``Detection.glue``) is encoded
  on its own (a step of a few tokens) before the request is planned again; a
  long unknown remainder after the loaded run is encoded in the background
  (``Detection.remainder``).
- **A request with a private namespace** (an anonymous caller, a key of the
  shared namespace): every text it brings between or before found passages is
  computed in its load's step (``Own.in_place``: where the workers have the
  model, ``server.startup``), or else encoded for it alone (``Own``: under its
  secret suffix, in its own namespace, never indexed); nothing else is stored:
  its course is the same whatever any other caller sent before it.
- **A reader** stores nothing: the load stops at the first text no entry holds.

A longer unknown text before the first found passages (an agent's new question
and tool call, ahead of the passages its tool returned: ``Detection.prefix``)
would stop the load at position 0, since vLLM's external tokens are a prefix of
the prompt. The prompt's whole prefix up to those passages is then computed
exactly first and stored (as glue is), and the request is planned again with
it as its first piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvrag_integrations.chunk_kv import cache_key
from kvrag_integrations.matching import ContentIndex
from kvrag_integrations.vllm.config import DEFAULT_LEARN_MIN_TOKENS, DEFAULT_MAX_ENTRY_TOKENS
from kvrag_integrations.vllm.params import PieceSpec

MAX_GLUE_TOKENS = 32  # text between two found passages that is looked up (and stored) as glue
# A longer unknown text before the first found passages (a new question and an agent's
# tool call ahead of the tool's passages) is no glue: the prompt's prefix up to them, at
# most this long, is computed exactly and stored first (``Detection.prefix``), where at
# least MIN_PREFIX_GAIN found tokens follow it (what its encode buys).
MAX_PREFIX_TOKENS = 1024
MIN_PREFIX_GAIN = 64
MIN_SHARE = 0.5  # a request that would load less than this share runs exactly and is learned
MAX_ENCODES_PER_REQUEST = 8  # glue spans one request may have encoded
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
class Own:
    """A request's own texts: where they are stored for it alone (the storage
    fingerprint of its private namespace), the secret suffix their entries' ids
    end in, and the spans of it encoded so far; or, ``in_place``, none stored:
    each is a computed piece (``PieceSpec.computed``), its rows computed in the
    load's step (the suffix then salts the request alone)."""

    fingerprint: str
    tail: tuple[int, ...]
    ready: frozenset[tuple[int, ...]] = frozenset()
    in_place: bool = False


@dataclass(frozen=True)
class Detection:
    """What the server does with one request.

    Attributes:
        load: the leading run of stored pieces to load (empty: load nothing).
        learn_prompt: store the whole prompt as one entry (the request then loads
            nothing and is computed exactly).
        remainder: id spans to encode on their own in the background (a long
            unknown remainder after the load).
        glue: short text between found passages (and the prompt's prefix up to
            ``prefix``) that no entry holds yet: encoded on its own (a step of a
            few tokens), in the tenant's namespace or the request's own, before
            the request is planned again.
        reason: why the load stops where it does (logged).
        prefix: where the found passages after a longer unknown text at the
            prompt's start begin (0: none such): the prompt's prefix up to there,
            computed exactly and stored first, lets them load.
    """

    load: tuple[PieceSpec, ...] = ()
    learn_prompt: bool = False
    remainder: tuple[tuple[int, ...], ...] = ()
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
        learn_min_tokens: shorter prompts are not learned, nor remainders stored (0:
            the server learns nothing; it still finds what was ingested).
        control_ids: the model's structural token ids (``markup_after``).
    """

    index: RunIndex
    contains: Callable[[str], bool]
    base_fingerprint: str
    max_entry_tokens: int = DEFAULT_MAX_ENTRY_TOKENS
    learn_min_tokens: int = DEFAULT_LEARN_MIN_TOKENS
    max_glue_tokens: int = MAX_GLUE_TOKENS
    max_prefix_tokens: int = MAX_PREFIX_TOKENS
    min_share: float = MIN_SHARE
    control_ids: frozenset[int] = frozenset()
    _known: dict[str, bool] = field(default_factory=dict, repr=False)

    def detect(
        self, fingerprint: str, prompt: Sequence[int], keeps: bool, own: Own | None = None
    ) -> Detection:
        """The plan for ``prompt`` in the namespace of ``fingerprint`` (the tenant's
        storage fingerprint). ``keeps``: the server may store what the caller sent
        in that namespace (its prompt, a remainder, glue and a prefix no entry
        holds yet). ``own``: the request's private namespace, where its glue and
        prefix go instead (and nothing else of it is stored); neither: a reader,
        nothing stored."""
        self._known.clear()  # existence is asked afresh for each request
        prompt = list(prompt)
        runs = self._stored_runs(fingerprint, prompt)
        learnable = 0 < self.learn_min_tokens <= len(prompt) <= self.max_entry_tokens
        learn_prompt = keeps and learnable
        if not runs:
            return Detection(learn_prompt=learn_prompt, reason="no stored passage in the prompt")
        pieces, glue, end, reason, head = self._run(fingerprint, prompt, runs, own)
        encodes = keeps or own is not None
        glue = tuple(dict.fromkeys(glue))[: MAX_ENCODES_PER_REQUEST + 1] if encodes else ()
        if end < self.min_share * len(prompt) and learn_prompt:
            # Little to reuse: computing it all costs about as much, and the whole
            # prompt stored makes every passage in it reusable in any order next time.
            return Detection(
                learn_prompt=True,
                glue=glue,
                reason=f"{reason}; only {end} of {len(prompt)} tokens reusable: computed "
                "and stored whole",
                prefix=head,
            )
        remainder = []
        rest = len(prompt) - end
        if keeps and self.learn_min_tokens and self.learn_min_tokens <= rest:
            span = tuple(prompt[end : end + self.max_entry_tokens])
            if not self._stored(fingerprint, span):
                remainder.append(span)
        return Detection(tuple(pieces), False, tuple(remainder), glue, reason, head)

    def _stored_runs(self, fingerprint: str, prompt: list[int]) -> list[RunLike]:
        """The index's cover of ``prompt`` by runs whose context it holds
        (``_ContextCheck``), without entries the store has lost since they were
        indexed (they are forgotten, and the cover is asked again)."""
        held = _ContextCheck(prompt)
        for _ in range(3):
            runs = [
                r
                for r in self.index.cover(fingerprint, prompt, held)
                if not markup_after(r, prompt, self.control_ids)
            ]
            gone = {r.entry for r in runs if not self._stored(fingerprint, r.entry)}
            if not gone:
                return runs
            for ids in gone:
                self.index.remove(fingerprint, ids)
        return []

    def _run(
        self, fingerprint: str, prompt: list[int], runs: Sequence[RunLike], own: Own | None
    ) -> tuple[list[PieceSpec], list[tuple[int, ...]], int, str, int]:
        """The leading run of pieces (found passages, stored glue between them),
        the unknown glue and prefix seen, where the run ends, why, and where
        found passages after a longer unknown prefix begin (0: none, or too few)."""
        head = self._head(runs)
        pieces: list[PieceSpec] = []
        glue: list[tuple[int, ...]] = []
        position, stop = 0, ""
        if head:
            span = tuple(prompt[:head])
            piece = self._text(fingerprint, 0, span, own)
            if piece is None:
                glue.append(span)  # (first: computed before the rest is planned again)
            else:
                pieces.append(piece)
                position = head
        for run in runs:
            if run.start < position:  # (inside the prefix: its own entry holds it)
                if run.start + run.length <= position:
                    continue
                cut = position - run.start
                run = _Run(position, run.length - cut, run.entry, run.offset + cut)
            if run.start > position:
                gap = tuple(prompt[position : run.start])
                if len(gap) > self.max_glue_tokens:
                    stop = stop or f"{len(gap)} unknown tokens at {position}"
                elif (piece := self._text(fingerprint, position, gap, own)) is None:
                    glue.append(gap)
                    stop = stop or f"glue of {len(gap)} tokens at {position} not stored yet"
                elif not stop:
                    pieces.append(piece)
            if not stop:
                lead = run.entry[: run.offset]
                tail = run.entry[run.offset + run.length :]
                pieces.append(PieceSpec(run.start, run.length, tuple(tail), tuple(lead)))
            position = run.start + run.length
        end = pieces[-1].end if pieces else 0
        if not stop:
            stop = "the prompt's unknown remainder" if end < len(prompt) else "all stored"
        return pieces, glue, end, stop, head

    def _head(self, runs: Sequence[RunLike]) -> int:
        """Where found passages begin after the prompt's first longer unknown text,
        where that is within ``max_prefix_tokens`` of the start (0: none such, or
        fewer than ``MIN_PREFIX_GAIN`` found tokens follow it before the next)."""
        position, head, gain = 0, 0, 0
        for run in runs:
            if run.start + run.length <= position:
                continue
            if run.start - position > self.max_glue_tokens:
                if head:
                    break  # what loads after the prefix ends here
                if run.start > self.max_prefix_tokens:
                    return 0
                head = run.start
            if head:
                gain += run.start + run.length - max(run.start, position)
            position = run.start + run.length
        return head if gain >= MIN_PREFIX_GAIN else 0

    def _text(
        self, fingerprint: str, start: int, span: tuple[int, ...], own: Own | None
    ) -> PieceSpec | None:
        """The piece of a text between (or before) found passages, where it is
        stored: the request's own entry of it where it has a private namespace,
        else the tenant's (None: not stored)."""
        if own is not None and own.in_place:
            return PieceSpec(start, len(span), own.tail, computed=True)
        if own is not None:
            ready = span in own.ready
            return PieceSpec(start, len(span), own.tail, own=True) if ready else None
        return PieceSpec(start, len(span)) if self._stored(fingerprint, span) else None

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


def markup_after(run: RunLike, prompt: Sequence[int], control_ids: frozenset[int]) -> bool:
    """Whether ``run`` continues a stored text right after a control token of the
    prompt that the entry does not hold there: a passage whose own text vLLM
    rendered as markup (vLLM tokenizes a rendered chat prompt with special-token
    strings as control tokens, documents' too). Its rows saw the text as
    characters; it is not loaded as a passage, the prompt computes it.

    Examples:
        >>> from types import SimpleNamespace as Run
        >>> markup_after(Run(start=3, offset=5), [7, 8, 2, 9], frozenset({2}))
        True
        >>> markup_after(Run(start=3, offset=0), [7, 8, 2, 9], frozenset({2}))
        False
    """
    return run.offset > 0 and run.start > 0 and prompt[run.start - 1] in control_ids


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
