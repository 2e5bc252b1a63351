"""What the KV connector tells back, in a finished request's ``kv_transfer_params``.

Under the same key as a request's params (``params.PARAMS_KEY``); no vLLM, no
torch: clients read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrag_integrations.vllm.params import PARAMS_KEY


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
        refused: why the connector refused the request's params ("" : it
            accepted them); such a request loaded and stored nothing.
        reuse: ``"blend"`` where the load was blended, else ``"turbo"``.
        blended: loaded tokens the workers recomputed (blend): they count in
            ``loaded`` too.
    """

    fingerprint: str
    loaded: int = 0
    recomputed: int = 0
    keys: list[str] = field(default_factory=list)
    stored: int = 0
    refused: str = ""
    reuse: str = "turbo"
    blended: int = 0

    def as_params(self) -> dict[str, Any]:
        return {
            PARAMS_KEY: {
                "fingerprint": self.fingerprint,
                "loaded": self.loaded,
                "recomputed": self.recomputed,
                "keys": list(self.keys),
                "stored": self.stored,
                "refused": self.refused,
                "reuse": self.reuse,
                "blended": self.blended,
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
            str(ours.get("reuse", "turbo")),
            int(ours.get("blended", 0)),
        )
