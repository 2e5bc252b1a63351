"""What a request tells the KV connector (what it tells back: ``reply``).

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
- ``deferred``: the ``save`` may be stored after the answer is returned (a deferred
  save: nothing waits for it, as for a prompt the server learns; an encode request's entry is stored
  before its answer).
- ``private``: the ``save`` goes to the request's private namespace
  (``admission.Admission.own``) and is not announced in the content index:
  an entry of a text an anonymous request brought (glue, a prefix), stored under
  ids with a secret suffix, read by that request alone and dropped after it.
  ``private_load``: the load pieces (by index) read from there.
- ``computed_load``: the load pieces (by index) that read no entry: the load's
  step computes their rows (turbo: each text alone, as its entry would have been
  encoded; blend: with the run's text) (an anonymous request's own texts).
- ``detect``: false opts a plain client's request out of the server's detection
  of stored passages (``server.reuse_hook``): it then runs exactly, as plain vLLM.
- ``tenant``: the client's own tenant salt (``TransferParams.tenant_salt``: the
  namespace it reuses and stores in; see ``trust``).
- ``reuse``: ``"turbo"`` or ``"blend"``: what the load run's reuse does (absent:
  the server's ``reuse``); a turbo server refuses blend.
- ``blend``: a blend load's own part (``BlendRequest``: the call's own options
  over the model's calibrated settings, and a nonce: the request's salt is then
  its own, so the blocks its recompute wrote are never another request's).
- ``admission``: what the server decided for the request where it entered
  (``admission.Admission``, signed): the server's own; a client that sends one
  is refused, as one that sends ``private``, ``private_load`` or
  ``computed_load`` (``SERVER_FIELDS``: only the server's hook stores, reads or
  computes a request's own texts).

Which of these a request may use, and under which ``cache_salt``, is its
admission's to say: a request the connector does not admit loads and stores
nothing and is computed exactly by vLLM.

The key of an entry is ``cache_key(fingerprint, ids)``, the fingerprint the
connector's (the weights it serves, the storage precision): the client never
needs it. The connector answers in the output's ``kv_transfer_params`` under
the same key (``reply.Reply``).
"""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import wraps
from typing import Any, ClassVar

from kvrag_integrations.errors import TransferParamsError
from kvrag_integrations.vllm.trust import MAX_SALT_CHARS, Tenant, ids_digest, request_salt

PARAMS_KEY = "kvrag"
"""The key of our part of a request's ``kv_transfer_params`` (and of the reply)."""

MAX_PIECES = 1024  # more pieces than any prompt has: a bound on what a request may ask
MAX_EDGE = 8192  # a piece's tail or lead: at most an entry's length
MAX_EDGE_IDS = 65536  # the ids of every piece's lead and tail together (a request's size)
BLEND_OPTIONS = ("recompute_ratio", "selection", "recompute_first")
_FIELDS = {
    "reuse",
    "blend",
    "load",
    "save",
    "overwrite",
    "tenant",
    "admission",
    "detect",
    "deferred",
    "private",
    "private_load",
    "computed_load",
}


SERVER_FIELDS = ("admission", "private", "private_load", "computed_load")
"""Fields only the server writes; a client's are refused where it enters."""


@dataclass(frozen=True)
class PieceSpec:
    """One stored piece of a prompt: ``rows`` prompt tokens from ``start``, read from
    (or saved as) the entry of ``prompt[start : start + rows] + tail``."""

    start: int
    rows: int
    tail: tuple[int, ...] = ()
    lead: tuple[int, ...] = ()  # the entry's ids before the piece (read from inside it)
    own: bool = False  # its entry is in the request's private namespace (``private_load``)
    computed: bool = False  # no entry: its rows are computed in the load's step

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
class BlendRequest:
    """A blend load's own part: the call's options over the model's calibrated
    settings, and the nonce that makes its salt its own.

    Examples:
        >>> b = BlendRequest(options={"recompute_ratio": 1.0}, nonce="n")
        >>> BlendRequest.from_json(b.as_json()) == b
        True
    """

    options: Mapping[str, Any] = field(default_factory=dict)
    nonce: str = ""

    NONCE_CHARS: ClassVar[int] = 16
    """The fewest characters of a nonce the connector takes (a fresh one: 32)."""

    def with_own_nonce(self) -> BlendRequest:
        """This request with a fresh nonce where it has none of its own (at least
        ``NONCE_CHARS``): its recomputed blocks are then its own."""
        if len(self.nonce) >= self.NONCE_CHARS:
            return self
        return replace(self, nonce=secrets.token_hex(16))

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nonce": self.nonce}
        if self.options:
            out["options"] = dict(sorted(self.options.items()))
        return out

    @classmethod
    def from_json(cls, raw: Any) -> BlendRequest:
        """Raises ``TransferParamsError`` if malformed."""
        if not isinstance(raw, Mapping) or set(raw) - {"options", "nonce"}:
            raise TransferParamsError("blend must be an object of options and nonce")
        options = raw.get("options", {})
        if not isinstance(options, Mapping) or set(options) - set(BLEND_OPTIONS):
            raise TransferParamsError(f"blend options are some of {BLEND_OPTIONS}")
        if not all(isinstance(v, (int, float, str)) for v in options.values()):
            raise TransferParamsError("blend options are numbers or names")
        nonce = raw.get("nonce", "")
        if not isinstance(nonce, str) or len(nonce) > 64:
            raise TransferParamsError("a blend nonce is a string of at most 64 characters")
        return cls(dict(options), nonce)


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
    tenant_salt: str = ""
    admission: Mapping[str, Any] | None = None
    detect: bool = True
    deferred: bool = False
    own_save: bool = False  # (``private``: the save goes to the private namespace)
    reuse: str = ""  # "turbo" or "blend" ("": the server's)
    blend: BlendRequest | None = None

    @property
    def load_end(self) -> int:
        """The prompt position the load run ends at (0: nothing to load)."""
        return self.load[-1].end if self.load else 0

    @property
    def tenant(self) -> str:
        """Deprecated: ``tenant_salt``."""
        warnings.warn(_TENANT_RENAMED, DeprecationWarning, stacklevel=2)
        return self.tenant_salt

    def as_request(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` of a request carrying these."""
        ours: dict[str, Any] = {}
        if self.load:
            ours["load"] = [p.as_list() for p in self.load]
        if self.save:
            ours["save"] = [p.as_list() for p in self.save]
        if self.overwrite:
            ours["overwrite"] = True
        if self.tenant_salt:
            ours["tenant"] = self.tenant_salt
        if self.admission is not None:
            ours["admission"] = dict(self.admission)
        if not self.detect:
            ours["detect"] = False
        if self.deferred:
            ours["deferred"] = True
        if self.own_save:
            ours["private"] = True
        if self.reuse:
            ours["reuse"] = self.reuse
        if self.blend is not None:
            ours["blend"] = self.blend.as_json()
        own = [i for i, piece in enumerate(self.load) if piece.own]
        if own:
            ours["private_load"] = own
        computed = [i for i, piece in enumerate(self.load) if piece.computed]
        if computed:
            ours["computed_load"] = computed
        return {PARAMS_KEY: ours}

    @property
    def layout(self) -> list[list[Any]]:
        """The load run as ``[start, rows, tail]`` lists (what salts hash); a piece
        read from inside an entry as ``[start, rows, tail digest, lead digest]``
        (its entry's ids can be thousands)."""
        layout = [p.as_list() if not p.lead else _digested(p) for p in self.load]
        layout = [[*p, "private"] if piece.own else p for p, piece in zip(layout, self.load)]
        layout = [[*p, "computed"] if q.computed else p for p, q in zip(layout, self.load)]
        if self.reuse == "blend":  # a blend load's blocks are its own (its nonce)
            blend = self.blend.as_json() if self.blend is not None else {}
            layout.append(["reuse", self.reuse, sorted(blend.items())])
        return layout

    def salt(self) -> str | None:
        """The ``cache_salt`` these params need, for a client's own tenant
        (``trust.request_salt``; a server sets the salt of its admission)."""
        return request_salt(Tenant.of_salt(self.tenant_salt), self.layout)

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
        tenant_salt = ours.get("tenant", "")
        if not isinstance(tenant_salt, str) or len(tenant_salt) > MAX_SALT_CHARS:
            raise TransferParamsError(
                f"tenant must be a string of at most {MAX_SALT_CHARS} characters"
            )
        admission = ours.get("admission")
        if admission is not None and not isinstance(admission, Mapping):
            raise TransferParamsError("admission must be an object")
        detect, deferred = ours.get("detect", True), ours.get("deferred", False)
        private = ours.get("private", False)
        if not all(isinstance(flag, bool) for flag in (detect, deferred, private)):
            raise TransferParamsError("detect, deferred and private must be true or false")
        if private and not save:
            raise TransferParamsError("private applies to a save")
        own = _indices(ours, "private_load", len(load))
        computed = _indices(ours, "computed_load", len(load))
        if own & computed:
            raise TransferParamsError("a computed piece reads no entry: it is not private_load")
        load = tuple(
            replace(p, own=i in own, computed=i in computed) if i in own | computed else p
            for i, p in enumerate(load)
        )
        reuse = ours.get("reuse", "")
        if reuse not in ("", "turbo", "blend"):
            raise TransferParamsError("reuse must be 'turbo' or 'blend'")
        blend = BlendRequest.from_json(ours["blend"]) if "blend" in ours else None
        if blend is not None and reuse != "blend":
            raise TransferParamsError("blend's layout goes with reuse 'blend'")
        return cls(
            load, save, overwrite, tenant_salt, admission, detect, deferred, private, reuse, blend
        )

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """Raise ``TransferParamsError`` if a piece lies beyond the prompt."""
        for piece in (*self.load, *self.save):
            if piece.end > num_prompt_tokens:
                raise TransferParamsError(
                    f"a piece ends at {piece.end}, beyond the {num_prompt_tokens}-token prompt"
                )


_TENANT_RENAMED = "TransferParams' tenant is named tenant_salt (the JSON field stays 'tenant')"


def _accept_tenant(init: Any) -> Any:
    """``TransferParams(tenant=...)``, the old keyword, kept with a DeprecationWarning."""

    @wraps(init)
    def __init__(
        self: TransferParams, *args: Any, tenant: str | None = None, **kwargs: Any
    ) -> None:
        if tenant is not None:
            warnings.warn(_TENANT_RENAMED, DeprecationWarning, stacklevel=2)
            kwargs.setdefault("tenant_salt", tenant)
        init(self, *args, **kwargs)

    return __init__


TransferParams.__init__ = _accept_tenant(TransferParams.__init__)  # type: ignore[method-assign]


def _digested(piece: PieceSpec) -> list[Any]:
    return [piece.start, piece.rows, ids_digest(piece.tail), ids_digest(piece.lead)]


def _int(value: Any, what: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TransferParamsError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _indices(ours: Mapping[str, Any], name: str, pieces: int) -> set[int]:
    """The load pieces a field lists by index."""
    raw = ours.get(name, [])
    if not isinstance(raw, list) or len(raw) > pieces:
        raise TransferParamsError(f"{name} lists load pieces by index")
    indices = {_int(i, f"a {name} index", 0) for i in raw}
    if any(i >= pieces for i in indices):
        raise TransferParamsError(f"{name} lists load pieces by index")
    return indices


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
