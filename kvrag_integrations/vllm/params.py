"""What a request tells the KV connector, and what the connector tells back.

Neither vLLM nor torch is imported here: ``VLLMEngine`` (which may be a client
on another machine) writes these, and the connector's scheduler and worker
sides read them. A request carries them in vLLM's per-request
``kv_transfer_params`` under :data:`PARAMS_KEY` (in process:
``SamplingParams(extra_args={"kv_transfer_params": ...})``; over the OpenAI
API: the request body's ``kv_transfer_params``):

- ``load``: the prompt's leading run of stored pieces, each ``[start, rows,
  tail]`` or ``[start, rows, tail, lead]``: prompt positions ``start .. start +
  rows`` are read from the entry whose ids are ``lead + prompt[start : start +
  rows] + tail`` (``tail``: the chunk suffix's ids where the prompt does not
  continue with it; ``lead``: the entry's ids before the piece, where a piece
  is read from inside an entry: a passage found in a stored prompt), rows
  ``len(lead) ..`` of it, its keys moved from ``len(lead)`` to ``start``. The
  run starts at 0 and has no gaps; the connector loads its longest stored
  prefix and vLLM computes the rest (TurboRAG).
- ``save``: pieces of this prompt to store as entries (chunk encoding):
  ``[start, rows, []]``, the entry's ids ``prompt[start : start + rows]``.
- ``overwrite``: store even where an entry exists (the admin role only).
- ``deferred``: the ``save`` may be stored after the answer is returned (a prompt
  the server learns: nothing waits for it; an encode request's entry is stored
  before its answer).
- ``private``: the ``save`` goes to the request's private namespace
  (``admission.Admission.private``) and is not announced in the content index:
  an entry of a text an anonymous request brought (glue, a prefix), stored under
  ids with a secret suffix, read by that request alone and dropped after it.
  ``private_load``: the load pieces (by index) read from there.
- ``detect``: false opts a plain client's request out of the server's detection
  of stored passages (``server.reuse_hook``): it then runs exactly, as plain vLLM.
- ``tenant``: the client's own tenant salt (the namespace it reuses and stores
  in; see ``trust``).
- ``admission``: what the server decided for the request where it entered
  (``admission.Admission``, signed): the server's own; a client that sends one
  is refused.

Which of these a request may use, and under which ``cache_salt``, is its
admission's to say: a request the connector does not admit loads and stores
nothing and is computed exactly by vLLM.

The key of an entry is ``cache_key(fingerprint, ids)``, the fingerprint the
connector's (the weights it serves, the storage precision): the client never
needs it. The connector answers in the output's ``kv_transfer_params`` under
the same key (``Reply``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.vllm.trust import Tenant, request_salt

PARAMS_KEY = "kvrag"
"""The key of our part of a request's ``kv_transfer_params`` (and of the reply)."""

MAX_PIECES = 1024  # more pieces than any prompt has: a bound on what a request may ask
MAX_EDGE = 8192  # a piece's tail or lead: at most an entry's length
MAX_EDGE_IDS = 65536  # the ids of every piece's lead and tail together (a request's size)
_FIELDS = {
    "load",
    "save",
    "overwrite",
    "tenant",
    "admission",
    "detect",
    "deferred",
    "private",
    "private_load",
}


@dataclass(frozen=True)
class PieceSpec:
    """One stored piece of a prompt: ``rows`` prompt tokens from ``start``, read from
    (or saved as) the entry of ``prompt[start : start + rows] + tail``."""

    start: int
    rows: int
    tail: tuple[int, ...] = ()
    lead: tuple[int, ...] = ()  # the entry's ids before the piece (read from inside it)
    private: bool = False  # its entry is in the request's own namespace (``private_load``)

    @property
    def end(self) -> int:
        return self.start + self.rows

    def entry_ids(self, prompt_ids: Sequence[int]) -> list[int]:
        """The ids of this piece's entry (the one place they are derived)."""
        return [*self.lead, *prompt_ids[self.start : self.end], *self.tail]

    def as_list(self) -> list[Any]:
        if self.lead:
            return [self.start, self.rows, list(self.tail), list(self.lead)]
        return [self.start, self.rows, list(self.tail)]


@dataclass(frozen=True)
class TransferParams:
    """A request's instructions to the connector (see the module docstring).

    Examples:
        >>> p = TransferParams(load=(PieceSpec(0, 5), PieceSpec(5, 3, (198,))))
        >>> TransferParams.from_request(p.as_request()) == p
        True
        >>> p.load_end
        8
        >>> TransferParams.from_request({"kvrag": {"load": [[1, 4, []]]}})
        Traceback (most recent call last):
        ...
        kvrag_integrations.errors.TransferParamsError: load pieces must start at 0 \
and follow each other; piece 0 starts at 1, not 0
    """

    load: tuple[PieceSpec, ...] = ()
    save: tuple[PieceSpec, ...] = ()
    overwrite: bool = False
    tenant: str = ""
    admission: Mapping[str, Any] | None = None
    detect: bool = True
    deferred: bool = False
    private: bool = False

    @property
    def load_end(self) -> int:
        """The prompt position the load run ends at (0: nothing to load)."""
        return self.load[-1].end if self.load else 0

    def as_request(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` of a request carrying these."""
        ours: dict[str, Any] = {}
        if self.load:
            ours["load"] = [p.as_list() for p in self.load]
        if self.save:
            ours["save"] = [p.as_list() for p in self.save]
        if self.overwrite:
            ours["overwrite"] = True
        if self.tenant:
            ours["tenant"] = self.tenant
        if self.admission is not None:
            ours["admission"] = dict(self.admission)
        if not self.detect:
            ours["detect"] = False
        if self.deferred:
            ours["deferred"] = True
        if self.private:
            ours["private"] = True
        own = [i for i, piece in enumerate(self.load) if piece.private]
        if own:
            ours["private_load"] = own
        return {PARAMS_KEY: ours}

    @property
    def layout(self) -> list[list[Any]]:
        """The load run as ``[start, rows, tail]`` lists (what salts hash); a piece
        read from inside an entry as ``[start, rows, tail digest, lead digest]``
        (its entry's ids can be thousands)."""
        layout = [p.as_list() if not p.lead else _digested(p) for p in self.load]
        return [[*p, "private"] if piece.private else p for p, piece in zip(layout, self.load)]

    def salt(self) -> str | None:
        """The ``cache_salt`` these params need, for a client's own tenant
        (``trust.request_salt``; a server sets the salt of its admission)."""
        return request_salt(Tenant.of_salt(self.tenant), self.layout)

    @classmethod
    def from_request(cls, kv_transfer_params: Any) -> TransferParams | None:
        """Read a request's params (None: it carries none of ours).

        Raises:
            TransferParamsError: they are malformed.
        """
        if not isinstance(kv_transfer_params, Mapping):
            return None
        ours = kv_transfer_params.get(PARAMS_KEY)
        if ours is None:
            return None
        if not isinstance(ours, Mapping):
            raise TransferParamsError(f"kv_transfer_params[{PARAMS_KEY!r}] must be an object")
        unknown = set(ours) - _FIELDS
        if unknown:
            raise TransferParamsError(f"unknown fields {sorted(unknown)}")
        load = _pieces(ours.get("load", []), "load")
        save = _pieces(ours.get("save", []), "save")
        position = 0
        for i, piece in enumerate(load):
            if piece.start != position:
                raise TransferParamsError(
                    "load pieces must start at 0 and follow each other; "
                    f"piece {i} starts at {piece.start}, not {position}"
                )
            position = piece.end
        overwrite = ours.get("overwrite", False)
        if not isinstance(overwrite, bool):
            raise TransferParamsError("overwrite must be true or false")
        tenant = ours.get("tenant", "")
        if not isinstance(tenant, str) or len(tenant) > 256:
            raise TransferParamsError("tenant must be a string of at most 256 characters")
        admission = ours.get("admission")
        if admission is not None and not isinstance(admission, Mapping):
            raise TransferParamsError("admission must be an object")
        detect, deferred = ours.get("detect", True), ours.get("deferred", False)
        private = ours.get("private", False)
        if not all(isinstance(flag, bool) for flag in (detect, deferred, private)):
            raise TransferParamsError("detect, deferred and private must be true or false")
        if private and not save:
            raise TransferParamsError("private applies to a save")
        own = ours.get("private_load", [])
        if not isinstance(own, list) or len(own) > len(load):
            raise TransferParamsError("private_load lists load pieces by index")
        indices = {_int(i, "a private_load index", 0) for i in own}
        if any(i >= len(load) for i in indices):
            raise TransferParamsError("private_load lists load pieces by index")
        load = tuple(replace(p, private=True) if i in indices else p for i, p in enumerate(load))
        return cls(load, save, overwrite, tenant, admission, detect, deferred, private)

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """Raise ``TransferParamsError`` if a piece lies beyond the prompt."""
        for piece in (*self.load, *self.save):
            if piece.end > num_prompt_tokens:
                raise TransferParamsError(
                    f"a piece ends at {piece.end}, beyond the {num_prompt_tokens}-token prompt"
                )


def _digested(piece: PieceSpec) -> list[Any]:
    def digest(ids: Sequence[int]) -> str:
        return hashlib.sha256(array("q", ids).tobytes()).hexdigest()[:32]

    return [piece.start, piece.rows, digest(piece.tail), digest(piece.lead)]


def _int(value: Any, what: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TransferParamsError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _pieces(raw: Any, what: str) -> tuple[PieceSpec, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_PIECES:
        raise TransferParamsError(f"{what} must be a list of at most {MAX_PIECES} pieces")
    out = []
    edge_ids = 0
    for item in raw:
        if (
            not isinstance(item, list)
            or len(item) not in (3, 4)
            or not all(isinstance(edge, list) for edge in item[2:])
        ):
            raise TransferParamsError(
                f"each {what} piece must be [start, rows, [tail ids]] or "
                "[start, rows, [tail ids], [lead ids]]"
            )
        start = _int(item[0], f"{what} start", 0)
        rows = _int(item[1], f"{what} rows", 1)
        raw_lead = item[3] if len(item) == 4 else []
        if max(len(item[2]), len(raw_lead)) > MAX_EDGE:
            raise TransferParamsError(
                f"a {what} piece's tail and lead have at most {MAX_EDGE} ids each"
            )
        edge_ids += len(item[2]) + len(raw_lead)
        if edge_ids > MAX_EDGE_IDS:
            raise TransferParamsError(f"a request's pieces have at most {MAX_EDGE_IDS} edge ids")
        tail = tuple(_int(t, f"{what} tail id", 0) for t in item[2])
        lead = tuple(_int(t, f"{what} lead id", 0) for t in raw_lead)
        if what == "save" and lead:
            raise TransferParamsError("a save piece has no lead")
        out.append(PieceSpec(start, rows, tail, lead))
    return tuple(out)


@dataclass
class Reply:
    """What the connector reports in a finished request's ``kv_transfer_params``.

    Attributes:
        fingerprint: the connector's storage fingerprint (model, precision).
        loaded: prompt tokens written from the store into vLLM's cache and used.
        recomputed: prompt tokens the workers could not load after the lookup
            promised them (an entry corrupt, foreign or gone since): vLLM
            computed them, though its count of cached tokens still has them.
        keys: the store key of each ``save`` piece, in order.
        stored: how many of them this request wrote (the others were stored).
        refused: why the connector did not admit the request's params ("" : it
            did); such a request loaded and stored nothing.
    """

    fingerprint: str
    loaded: int = 0
    recomputed: int = 0
    keys: list[str] = field(default_factory=list)
    stored: int = 0
    refused: str = ""

    def as_params(self) -> dict[str, Any]:
        return {
            PARAMS_KEY: {
                "fingerprint": self.fingerprint,
                "loaded": self.loaded,
                "recomputed": self.recomputed,
                "keys": list(self.keys),
                "stored": self.stored,
                "refused": self.refused,
            }
        }

    @classmethod
    def from_output(cls, kv_transfer_params: Any) -> Reply | None:
        """The reply in an output's ``kv_transfer_params`` (None if there is none)."""
        ours = (
            kv_transfer_params.get(PARAMS_KEY) if isinstance(kv_transfer_params, Mapping) else None
        )
        if not isinstance(ours, Mapping) or not isinstance(ours.get("fingerprint"), str):
            return None
        return cls(
            ours["fingerprint"],
            int(ours.get("loaded", 0)),
            int(ours.get("recomputed", 0)),
            [str(k) for k in ours.get("keys", [])],
            int(ours.get("stored", 0)),
            str(ours.get("refused", "")),
        )
