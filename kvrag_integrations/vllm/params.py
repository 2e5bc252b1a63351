"""What a request tells the KV connector, and what the connector tells back.

Neither vLLM nor torch is imported here: ``VLLMEngine`` (which may be a client
on another machine) writes these, and the connector's scheduler and worker
sides read them. A request carries them in vLLM's per-request
``kv_transfer_params`` under :data:`PARAMS_KEY` (in process:
``SamplingParams(extra_args={"kv_transfer_params": ...})``; over the OpenAI
API: the request body's ``kv_transfer_params``):

- ``load``: the prompt's leading run of stored pieces, each ``[start, rows,
  tail]``: prompt positions ``start .. start + rows`` are read from the entry
  whose ids are ``prompt[start : start + rows] + tail`` (``tail``: the chunk
  suffix's ids where the prompt does not continue with it), its keys moved from
  position 0 to ``start``. The run starts at 0 and has no gaps; the connector
  loads its longest stored prefix and vLLM computes the rest (TurboRAG).
- ``save``: pieces of this prompt to store as entries (chunk encoding):
  ``[start, rows, []]``, the entry's ids ``prompt[start : start + rows]``.
- ``overwrite``: store even where an entry exists.

The key of an entry is ``cache_key(fingerprint, ids)``, the fingerprint the
connector's (the weights it serves, the storage precision): the client never
needs it. The connector answers in the output's ``kv_transfer_params`` under
the same key (``Reply``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PARAMS_KEY = "kvrag"
"""The key of our part of a request's ``kv_transfer_params`` (and of the reply)."""

MAX_PIECES = 4096  # more pieces than any prompt has: a bound on what a request may ask

SALT_PREFIX = "kvrag-turbo-"
"""Every salt of an approximate (turbo) request starts with this: vLLM's own prefix
cache then never serves its blocks to a request with another salt or none."""


class TransferParamsError(ValueError):
    """A request's ``kv_transfer_params["kvrag"]`` is malformed (it is then ignored:
    the request is computed by vLLM as if it carried none)."""


@dataclass(frozen=True)
class PieceSpec:
    """One stored piece of a prompt: ``rows`` prompt tokens from ``start``, read from
    (or saved as) the entry of ``prompt[start : start + rows] + tail``."""

    start: int
    rows: int
    tail: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.rows

    def entry_ids(self, prompt_ids: Sequence[int]) -> list[int]:
        """The ids of this piece's entry."""
        return [*prompt_ids[self.start : self.end], *self.tail]

    def as_list(self) -> list[Any]:
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
        kvrag_integrations.vllm.params.TransferParamsError: load pieces must start at 0 \
and follow each other; piece 0 starts at 1, not 0
    """

    load: tuple[PieceSpec, ...] = ()
    save: tuple[PieceSpec, ...] = ()
    overwrite: bool = False

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
        return {PARAMS_KEY: ours}

    def salt(self) -> str | None:
        """The ``cache_salt`` of a request that loads these pieces (None: loads none).

        A turbo prompt's K/V depend on where its pieces start, not only on its
        tokens, so the salt is a hash of the layout: vLLM's prefix cache then
        shares blocks only between requests laid out alike (the same blocks),
        and never with an exact request (no salt, or another one).
        """
        if not self.load:
            return None
        layout = json.dumps([p.as_list() for p in self.load], separators=(",", ":"))
        return SALT_PREFIX + hashlib.sha256(layout.encode()).hexdigest()[:32]

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
        unknown = set(ours) - {"load", "save", "overwrite"}
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
        return cls(load, save, overwrite)

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """Raise ``TransferParamsError`` if a piece lies beyond the prompt."""
        for piece in (*self.load, *self.save):
            if piece.end > num_prompt_tokens:
                raise TransferParamsError(
                    f"a piece ends at {piece.end}, beyond the {num_prompt_tokens}-token prompt"
                )


def _int(value: Any, what: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TransferParamsError(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def _pieces(raw: Any, what: str) -> tuple[PieceSpec, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_PIECES:
        raise TransferParamsError(f"{what} must be a list of at most {MAX_PIECES} pieces")
    out = []
    for item in raw:
        if not isinstance(item, list) or len(item) != 3 or not isinstance(item[2], list):
            raise TransferParamsError(f"each {what} piece must be [start, rows, [tail ids]]")
        start = _int(item[0], f"{what} start", 0)
        rows = _int(item[1], f"{what} rows", 1)
        tail = tuple(_int(t, f"{what} tail id", 0) for t in item[2])
        out.append(PieceSpec(start, rows, tail))
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
    """

    fingerprint: str
    loaded: int = 0
    recomputed: int = 0
    keys: list[str] = field(default_factory=list)
    stored: int = 0

    def as_params(self) -> dict[str, Any]:
        return {
            PARAMS_KEY: {
                "fingerprint": self.fingerprint,
                "loaded": self.loaded,
                "recomputed": self.recomputed,
                "keys": list(self.keys),
                "stored": self.stored,
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
        )
