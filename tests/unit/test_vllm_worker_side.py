"""The connector's worker side without vLLM: slots, the paged layout probe, loads and saves.

vLLM's attention backends write a step's K/V with ``impl.do_kv_cache_update``;
here a fake backend op does, with a packing of its own (keys of a block
transposed, values interleaved), so nothing assumes one layout. Moved keys are
checked against transformers' own ``apply_rotary_pos_emb``; the store is a real
``MemoryKVStore``. The vLLM lane runs the same code inside vLLM.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvrag_integrations.chunk_kv import ChunkKV, cache_key
from kvrag_integrations.engine.blend_settings import BlendSettings
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.errors import PagedLayoutError
from kvrag_integrations.store import MemoryKVStore
from kvrag_integrations.store.write_budget import StoreBudget
from kvrag_integrations.vllm.connector.messages import BlendOp, LoadOp, PieceOp, SaveOp
from kvrag_integrations.vllm.connector.paged import PagedLayout, layer_index
from kvrag_integrations.vllm.connector.worker_side import WorkerSide
from kvrag_integrations.vllm.trust import Tenant

BLOCK = 4  # tokens per block
BLOCKS = 12
FP = "fp+kv-model"
CONFIG = transformers.LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
HEADS, DIM = 2, 16


class FakeImpl:
    """A write op with a packing of its own: per block ``[heads, BLOCK, 2 * DIM]``,
    keys transposed within a block (dim-major), values interleaved with them."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots) -> None:
        for i, slot in enumerate(slots.tolist()):
            block, offset = divmod(slot, BLOCK)
            flat = kv_cache[block].reshape(HEADS, -1)  # [heads, BLOCK * 2 * DIM]
            for h in range(HEADS):
                for d in range(DIM):
                    flat[h, d * BLOCK + offset] = key[i, h, d]  # keys: dim-major
                    flat[h, BLOCK * DIM + 2 * (offset * (DIM // 2) + d // 2) + d % 2] = value[
                        i, h, d
                    ]


def layer() -> SimpleNamespace:
    return SimpleNamespace(impl=FakeImpl())


def caches() -> dict[int, torch.Tensor]:
    return {i: torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM) for i in range(2)}


def worker(store: MemoryKVStore, budget: StoreBudget | None = None) -> WorkerSide:
    side = WorkerSide(store, FP, "model", ModelLayout.of_config(CONFIG), budget)
    kv = caches()
    side.register(
        {f"model.layers.{i}.self_attn.attn": c for i, c in kv.items()},
        {f"model.layers.{i}.self_attn.attn": layer() for i in kv},
    )
    side.scheduler_block_size = BLOCK
    return side


def entry(ids: list[int], namespace: str = "") -> ChunkKV:
    torch.manual_seed(len(ids))
    shape = (2, HEADS, len(ids), DIM)
    fp = Tenant(namespace).fingerprint(FP)
    return ChunkKV(torch.tensor(ids), torch.randn(shape), torch.randn(shape), fp)


def moved(keys: torch.Tensor, start: int) -> torch.Tensor:
    """transformers' own rotation of an entry's keys (each at its own position from 0)
    to a piece starting at ``start``: every row turns by ``start`` more."""
    n = keys.shape[-2]
    rotary = LlamaRotaryEmbedding(CONFIG)
    cos, sin = rotary(keys, torch.full((1, n), start))
    _, k = apply_rotary_pos_emb(keys.unsqueeze(0), keys.unsqueeze(0), cos, sin)
    return k[0]


def test_layer_index_and_slots() -> None:
    assert layer_index("model.layers.13.self_attn.attn") == 13
    with pytest.raises(ValueError):
        layer_index("lm_head")
    side = worker(MemoryKVStore())
    # positions 3..9 over blocks 7, 2, 5: the block of a position, then its offset
    assert side.slots([7, 2, 5], 3, 9).tolist() == [31, 8, 9, 10, 11, 20]


def test_the_probe_finds_the_packing_and_reads_back_what_was_written() -> None:
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM)
    paged = PagedLayout.probe(layer(), cache, DIM)
    keys, values = torch.randn(5, HEADS, DIM), torch.randn(5, HEADS, DIM)
    slots = torch.tensor([1, 2, 17, 30, 46])
    FakeImpl().do_kv_cache_update(None, keys, values, cache, slots)
    got_k, got_v = paged.read(cache, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)


def test_a_write_op_that_scatters_a_token_is_refused() -> None:
    class Lossy(FakeImpl):
        def do_kv_cache_update(self, layer, key, value, kv_cache, slots) -> None:
            kv_cache.zero_()  # writes nothing anywhere

    with pytest.raises(PagedLayoutError):
        PagedLayout.probe(SimpleNamespace(impl=Lossy()), torch.zeros(2, HEADS, BLOCK, 2 * DIM), DIM)


def test_a_load_writes_each_piece_at_its_slots_with_its_keys_moved() -> None:
    store = MemoryKVStore()
    first, second = entry([5, 6, 7]), entry([8, 9, 10, 11, 12, 99])  # 99: the tail
    store.put(first)
    store.put(second)
    side = worker(store)
    pieces = (PieceOp(0, 3, (5, 6, 7)), PieceOp(3, 5, (8, 9, 10, 11, 12, 99)))
    blocks = (4, 1, 9)
    assert side.load(LoadOp("r", blocks, 0, 8, pieces)) == 8
    paged = side._paged()
    for index in range(2):
        keys, values = paged.read(side.caches[index], side.slots(blocks, 0, 8))
        want_keys = torch.cat(
            [moved(first.keys[index], 0), moved(second.keys[index][:, :5], 3)], dim=1
        )
        want_values = torch.cat([first.values[index], second.values[index][:, :5]], dim=1)
        torch.testing.assert_close(keys.transpose(0, 1), want_keys, rtol=1e-5, atol=1e-5)
        assert torch.equal(values.transpose(0, 1), want_values)


def test_pieces_read_from_inside_an_entry_land_with_their_keys_moved_by_the_gap() -> None:
    # A stored prompt [1..10]; a new prompt holds its rows 6..9 first, then rows 1..4:
    # each row r of the entry lands at prompt position r + (start - offset).
    store = MemoryKVStore()
    stored = entry(list(range(1, 11)))
    store.put(stored)
    side = worker(store)
    ids = tuple(range(1, 11))
    pieces = (PieceOp(0, 4, ids, 6), PieceOp(4, 4, ids, 1))
    blocks = (2, 7)
    reads = []
    get = store.get
    store.get = lambda key, fp: reads.append(key) or get(key, fp)  # type: ignore[method-assign]
    assert side.load(LoadOp("r", blocks, 0, 8, pieces)) == 8
    assert len(reads) == 1  # two pieces of one entry: one read
    paged = side._paged()
    for index in range(2):
        keys, values = paged.read(side.caches[index], side.slots(blocks, 0, 8))
        # moving row r from r to r + shift is turning it by shift: transformers' rotation
        want = torch.cat(
            [moved(stored.keys[index][:, 6:10], -6), moved(stored.keys[index][:, 1:5], 3)], dim=1
        )
        torch.testing.assert_close(keys.transpose(0, 1), want, rtol=1e-5, atol=1e-5)
        want_values = torch.cat([stored.values[index][:, 6:10], stored.values[index][:, 1:5]], 1)
        assert torch.equal(values.transpose(0, 1), want_values)


def test_a_piece_beyond_its_entrys_rows_is_a_miss() -> None:
    store = MemoryKVStore()
    store.put(entry([1, 2, 3, 4]))
    side = worker(store)
    # the entry's ids say 4 rows; a piece asking rows 2..6 of an entry of other ids misses
    written = side.load(LoadOp("r", (1, 2), 0, 4, (PieceOp(0, 4, (1, 2, 3, 4, 5, 6), 2),)))
    assert written == 0 and side.take_failed_loads() == {"r": 0}


def test_a_missing_piece_fails_its_blocks_and_every_later_one() -> None:
    store = MemoryKVStore()
    store.put(entry([5, 6, 7, 8, 9]))
    side = worker(store)
    pieces = (PieceOp(0, 5, (5, 6, 7, 8, 9)), PieceOp(5, 4, (1, 2, 3, 4)))  # second: absent
    written = side.load(LoadOp("r", (3, 6, 8), 0, 9, pieces))
    assert written == 4  # up to the block the missing piece starts in
    assert side.take_failed_blocks() == {6, 8}
    assert side.take_failed_loads() == {"r": 4}


def test_a_load_reads_only_its_tenants_entries() -> None:
    store = MemoryKVStore()
    mine = Tenant.of_salt("team-a")
    store.put(entry([5, 6, 7], mine.namespace))
    side = worker(store)
    piece = (PieceOp(0, 3, (5, 6, 7)),)
    assert side.load(LoadOp("shared", (2,), 0, 3, piece)) == 0  # the shared namespace: absent
    own = (PieceOp(0, 3, (5, 6, 7), 0, mine.namespace),)
    assert side.load(LoadOp("a", (2,), 0, 3, own)) == 3


def test_a_save_reads_the_prompt_back_in_its_tenants_namespace() -> None:
    store = MemoryKVStore()
    side = worker(store)
    kv = entry([1, 2, 3, 4, 5])
    blocks = (7, 3)
    slots = side.slots(blocks, 0, 5)
    for index, cache in side.caches.items():
        FakeImpl().do_kv_cache_update(
            None, kv.keys[index].transpose(0, 1), kv.values[index].transpose(0, 1), cache, slots
        )
    tenant = Tenant.of_salt("team-a")
    piece = PieceOp(0, 5, (1, 2, 3, 4, 5), 0, tenant.namespace)
    assert side.save(SaveOp("s", blocks, (piece,))) == 1
    fingerprint = tenant.fingerprint(FP)
    got = store.get(cache_key(fingerprint, [1, 2, 3, 4, 5]), fingerprint)
    assert got is not None and torch.equal(got.keys, kv.keys) and torch.equal(got.values, kv.values)


def test_saves_keep_the_store_within_its_budget() -> None:
    store = MemoryKVStore()
    one = entry(list(range(8))).nbytes + 4096  # what a save of 8 tokens counts
    side = worker(store, StoreBudget(store, max_bytes=3 * one))
    for i in range(6):
        ids = tuple(range(10 * i, 10 * i + 8))
        assert side.save(SaveOp(f"s{i}", (0, 1), (PieceOp(0, 8, ids),))) == 1
        assert sum(e.nbytes for e in store.entries()) <= 3 * one
    assert (
        side.writes.budget is not None and side.writes.budget.evicted >= 2
    )  # the oldest went first
    assert store.contains(cache_key(FP, list(range(50, 58))))  # the newest stayed
    assert not StoreBudget(store, max_bytes=one).allow_write(2 * one)  # never fits: skipped


def test_a_learned_prompt_is_stored_after_the_step_and_announced_to_the_index() -> None:
    from kvrag_integrations.matching import MemoryIndexLog

    store, log = MemoryKVStore(), MemoryIndexLog()
    side = worker(store)
    side.writes.index_log = log
    blocks = (0, 1)
    for index, cache in side.caches.items():
        torch.manual_seed(index)
        cache.copy_(torch.randn_like(cache))
    op = SaveOp("s", blocks, (PieceOp(0, 6, (1, 2, 3, 4, 5, 6)),), background=True)
    assert side.save(op) == 1
    side.writes.drain()  # the writer thread has stored it by now
    key = cache_key(FP, [1, 2, 3, 4, 5, 6])
    stored = store.get(key, FP)
    assert stored is not None
    keys, _ = side._paged().read(side.caches[1], side.slots(blocks, 0, 6))
    torch.testing.assert_close(stored.keys[1], keys.transpose(0, 1))  # model precision
    assert [(ns, ids.tolist()) for ns, ids in log.read_new()] == [(FP, [1, 2, 3, 4, 5, 6])]


def test_a_private_entry_is_stored_but_not_announced_to_the_index() -> None:
    from kvrag_integrations.matching import MemoryIndexLog

    store, log = MemoryKVStore(), MemoryIndexLog()
    side = worker(store)
    side.writes.index_log = log
    op = SaveOp("p", (0, 1), (PieceOp(0, 6, (1, 2, 3, 4, 5, 6)),), indexed=False)
    assert side.save(op) == 1
    assert store.contains(cache_key(FP, [1, 2, 3, 4, 5, 6])) and log.read_new() == []


def test_refused_writes_are_counted_logged_and_reach_the_metrics(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 59 hole 13: refused writes were invisible: the worker's INFO lines never
    reached the server's log, and nothing counted them. The worker logs each (its
    namespace's kind of id) and counts it by the writer's kind of namespace; vLLM
    carries the counts to the API server (``get_kv_connector_stats``), whose
    ``/metrics`` serves them (``build_prom_metrics``, where vLLM is installed)."""
    from kvrag_integrations.store.quotas import Quotas
    from kvrag_integrations.vllm.connector.stats import KVRAGStats, budget_counts, counted

    store = MemoryKVStore()
    one = entry(list(range(8))).nbytes + 4096
    team = Tenant.of_key_namespace("team-a", b"x")
    side = worker(store, StoreBudget(store, max_bytes=4 * one, quotas=Quotas(0.5)))
    with caplog.at_level("INFO", logger="kvrag_integrations"):
        for i in range(6):  # the team's quota holds two: the others evict its own, then
            ids = tuple(range(10 * i, 10 * i + 8))
            side.save(SaveOp(f"s{i}", (0, 1), (PieceOp(0, 8, ids, 0, team.namespace),)))
        big = tuple(range(100, 124))  # more than its quota: refused
        assert (
            side.save(SaveOp("big", (0, 1, 2, 3, 4, 5), (PieceOp(0, 24, big, 0, team.namespace),)))
            == 0
        )
    assert any("entry refused" in r.getMessage() for r in caplog.records)
    stats = budget_counts(side.writes.budget)  # (what the worker's connector reports)
    assert stats["writes_refused:key"] == 1 and stats["entries_evicted"] >= 2
    assert budget_counts(side.writes.budget) == {"writes_refused:key": 0, "entries_evicted": 0}
    reported = counted(stats)
    assert isinstance(reported, KVRAGStats) and counted(budget_counts(side.writes.budget)) is None
    try:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

        from kvrag_integrations.vllm.connector.kv_connector import KVRAGConnector
    except ImportError:  # no vLLM here: the counts above are what it carries
        return
    registry = CollectorRegistry()

    class Registered(Counter):  # (a registry of the test's own)
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    kinds = {Counter: Registered, Gauge: Gauge, Histogram: Histogram}
    metrics = KVRAGConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None), kinds, ["engine"], {0: ["0"]}
    )
    metrics.observe(KVRAGConnector.build_kv_connector_stats(reported.data).data, 0)
    text = generate_latest(registry).decode()
    assert 'kvrag:store_writes_refused_total{engine="0",kind="key"} 1.0' in text


class RecordingBlender:
    """What the worker hands the model's runner (the real recompute is
    ``BlendRunner``'s, run in vLLM by the vLLM lane): blend ops, and the rows of
    texts computed alone."""

    def __init__(self) -> None:
        self.calls: list[tuple[BlendOp, list[int], list[int]]] = []
        self.alone: list[tuple[list[int], list[int], list[int], list[int]]] = []

    def run(self, op: BlendOp, ids: torch.Tensor, slots: torch.Tensor) -> int:
        self.calls.append((op, ids.tolist(), slots.tolist()))
        return sum(hi - lo for lo, hi in op.texts)

    def compute_alone(self, ids, positions, slots, texts) -> None:
        self.alone.append((ids.tolist(), positions.tolist(), slots.tolist(), texts.tolist()))


def test_a_turbo_loads_computed_pieces_read_nothing_and_are_computed_once_per_step() -> None:
    """Texts a request brought between stored passages (``PieceSpec.computed``): the
    passages are written around them; the texts of every load of the step are
    computed in one forward, each alone, at their own positions and slots."""
    store = MemoryKVStore()
    first, second = entry([5, 6, 7]), entry([8, 9, 10, 11])
    store.put(first)
    store.put(second)
    side = worker(store)
    side.blender = RecordingBlender()
    text = PieceOp(3, 2, (40, 41, 77, 78), computed=True)  # its ids, then a secret tail
    pieces = (PieceOp(0, 3, (5, 6, 7)), text, PieceOp(5, 4, (8, 9, 10, 11)))
    head = PieceOp(0, 2, (50, 51, 79), computed=True)  # another request's, at position 0
    assert side.load(LoadOp("r", (4, 1, 9), 0, 9, pieces)) == 9
    assert side.load(LoadOp("q", (2, 3), 0, 5, (head, PieceOp(2, 3, (5, 6, 7))))) == 5
    assert not side.blender.alone  # (not before every load of the step is written)
    side.compute_texts()
    ((ids, positions, slots, texts),) = side.blender.alone
    assert ids == [40, 41, 50, 51] and positions == [3, 4, 0, 1] and texts == [0, 0, 1, 1]
    assert slots == side.slots((4, 1, 9), 3, 5).tolist() + side.slots((2, 3), 0, 2).tolist()
    assert side.take_failed_loads() == {} and not side.blender.calls
    paged = side._paged()
    for index in range(2):
        keys, values = paged.read(side.caches[index], side.slots((4, 1, 9), 5, 9))
        torch.testing.assert_close(keys.transpose(0, 1), moved(second.keys[index], 5))
        assert torch.equal(values.transpose(0, 1), second.values[index])
        _, text_values = paged.read(side.caches[index], side.slots((4, 1, 9), 3, 5))
        assert not text_values.any()  # nothing was read for it: its forward writes it


def test_a_blend_loads_computed_piece_is_its_blend_ops() -> None:
    store = MemoryKVStore()
    store.put(entry([5, 6, 7]))
    side = worker(store)
    side.blender = RecordingBlender()
    pieces = (PieceOp(0, 3, (5, 6, 7)), PieceOp(3, 2, (40, 41, 77), computed=True))
    op = BlendOp(BlendSettings(recompute_ratio=0.0), 3, (), ((3, 5),))
    assert side.load(LoadOp("r", (4, 1), 0, 5, pieces, op)) == 5
    side.compute_texts()
    ((got, ids, _),) = side.blender.calls
    assert got == op and ids == [5, 6, 7, 40, 41] and not side.blender.alone
    assert side.take_blended() == {"r": 2}


def test_computed_pieces_that_cannot_be_computed_fail_their_loads() -> None:
    """No model attached: every load with computed pieces is a miss from its start
    (recomputed by vLLM), never left with unwritten rows; so is a load whose start
    (vLLM's own cache) cuts a computed piece."""
    store = MemoryKVStore()
    store.put(entry([5, 6, 7]))
    side = worker(store)
    pieces = (PieceOp(0, 3, (5, 6, 7)), PieceOp(3, 2, (40, 41), computed=True))
    side.load(LoadOp("r", (4, 1), 0, 5, pieces))
    side.load(LoadOp("plain", (2,), 0, 3, pieces[:1]))
    side.compute_texts()
    assert side.take_failed_loads() == {"r": 0}
    side.blender = RecordingBlender()
    cut = (PieceOp(0, 6, tuple(range(6)), computed=True), PieceOp(6, 3, (5, 6, 7)))
    assert side.load(LoadOp("c", (4, 1, 2), 4, 9, cut)) == 0
    assert side.take_failed_loads() == {"c": 4}
