"""Floods of writes into a store kept by ``StoreBudget``, written as a server's worker
writes them: what every other tenant keeps.

Both tiers run these on real stores: memory and disk in
``tests/unit/test_store_isolation.py``, Redis in
``tests/integration/test_store_quotas_redis.py``. Entries are synthetic (no
model); their fingerprints are the ones ``Tenant`` gives each kind of tenant.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from kvrag_integrations.chunk_kv import ChunkKV
from kvrag_integrations.store import KVStore
from kvrag_integrations.store.quotas import Quotas
from kvrag_integrations.store.write_budget import StoreBudget
from kvrag_integrations.vllm.trust import Tenant

BASE = "model-fp"
HEADER = 4096  # what the worker charges an entry beyond its tensors
KEY_A, KEY_B = (Tenant.of_key_namespace(name, b"secret") for name in ("team-a", "team-b"))
TEAM_SALT = Tenant.of_salt("team-s")  # a team sharing a secret salt
SHARED = Tenant()

_seeds = iter(range(10**6, 10**9))


def make_kv(tenant: Tenant, n: int = 16, seed: int | None = None) -> ChunkKV:
    """An entry of ``n`` tokens of ``tenant``'s namespace (distinct ids per call)."""
    seed = next(_seeds) if seed is None else seed
    gen = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn((2, 2, n, 8), generator=gen) for _ in range(2))
    ids = torch.arange(seed * 1000, seed * 1000 + n)
    return ChunkKV(ids, keys, values, tenant.fingerprint(BASE))


UNIT = make_kv(SHARED, seed=0).nbytes + HEADER  # what one 16-token entry is charged


@dataclass
class Budgeted:
    """A store under a budget of ``units`` 16-token entries, each key namespace with
    its quota (half of it), salts and private entries in their pools."""

    store: KVStore
    units: int = 64
    most: int = 0  # the most the store held after a write
    refused: int = 0
    residents: list[ChunkKV] = field(default_factory=list)
    seconds: float = 0.0  # the budget's clock (``wait`` moves it)

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """A budget that knows nothing of the store yet (a server started anew)."""
        named = {KEY_A.namespace: 0, KEY_B.namespace: 0}
        self.budget = StoreBudget(
            self.store, self.units * UNIT, quotas=Quotas(0.5, named), clock=lambda: self.seconds
        )

    def wait(self, seconds: float) -> None:
        self.seconds += seconds

    def write(self, kv: ChunkKV) -> bool:
        """What the connector's worker does with an entry it stores."""
        if not self.budget.allow_write(kv.nbytes + HEADER, kv.fingerprint):
            self.refused += 1
            return False
        self.store.put(kv)
        self.most = max(self.most, self.held())
        return True

    def held(self, *tenants: Tenant) -> int:
        """Bytes the store holds (of ``tenants``' namespaces only, where given)."""
        fingerprints = {t.fingerprint(BASE) for t in tenants}
        return sum(
            i.nbytes for i in self.store.entries() if not tenants or i.fingerprint in fingerprints
        )

    def held_by_kind(self, kind: str) -> int:
        return sum(i.nbytes for i in self.store.entries() if f"+ns-{kind}-" in i.fingerprint)

    def settle(self) -> list[ChunkKV]:
        """The others, within their quotas before a flood: three passages ingested in
        the shared namespace, three entries of each key tenant, two of a salt's."""
        tenants = [SHARED] * 3 + [KEY_A] * 3 + [KEY_B] * 3 + [TEAM_SALT] * 2
        self.residents = [make_kv(tenant) for tenant in tenants]
        for kv in self.residents:
            assert self.write(kv)
        return self.residents

    def missing(self, *but: Tenant) -> list[str]:
        """The residents gone from the store (those of ``but`` not counted)."""
        skip = {t.fingerprint(BASE) for t in but}
        return [
            kv.fingerprint
            for kv in self.residents
            if kv.fingerprint not in skip and not self.store.contains(kv.key)
        ]


def anonymous_agent_flood(b: Budgeted, waves: int = 10, at_once: int = 12) -> int:
    """Anonymous agent calls, ``at_once`` at a time: each stores its private prefix
    (32 tokens, in the namespace of that request alone) and drops it once
    answered seconds later, as the reuse hook does; the last wave is left
    unanswered. Returns how many prefixes were stored."""
    stored = 0
    for wave in range(waves):
        prefixes = [
            make_kv(Tenant.of_request("anonymous", secrets.token_hex(16)), n=32)
            for _ in range(at_once)
        ]
        written = [kv for kv in prefixes if b.write(kv)]
        stored += len(written)
        if wave < waves - 1:
            for kv in written:
                b.store.delete(kv.key)
            b.wait(5.0)
    return stored


def salt_flood(b: Budgeted, salts: int = 300) -> int:
    """A client minting a salt per request, each storing one entry. Returns how many
    were stored."""
    return sum(b.write(make_kv(Tenant.of_salt(f"flood-{i}"))) for i in range(salts))


def past_quota(b: Budgeted, tenant: Tenant, writes: int = 200) -> None:
    """``tenant`` learning ``writes`` distinct prompts, past its quota."""
    for _ in range(writes):
        assert b.write(make_kv(tenant))  # its own entries give way: never refused
