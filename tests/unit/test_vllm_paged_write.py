"""A load's writes into the paged cache: strided copies of whole blocks where the
backend's op is a plain copy to affine places, the op everywhere else, and the
same cache either way; entries in every stored form gathered as they were cast;
a disk store's entries read on threads, each verified.

The fake backend op and the worker come from ``test_vllm_worker_side``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_vllm_worker_side import BLOCK, BLOCKS, DIM, HEADS, FakeImpl, entry, moved, worker

from kvrag_integrations.store import DiskKVStore, MemoryKVStore
from kvrag_integrations.vllm.connector.messages import LoadOp, PieceOp
from kvrag_integrations.vllm.connector.paged import PagedLayout, write


class Rounding(FakeImpl):
    """Places values as ``FakeImpl`` does, but rounds them (as a quantizing op would)."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots) -> None:
        super().do_kv_cache_update(layer, key.round(), value.round(), kv_cache, slots)


class Shuffled(FakeImpl):
    """Puts each token of a block at another offset, not by a stride."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots) -> None:
        order = torch.tensor([0, 2, 1, 3])
        moved_slots = slots // BLOCK * BLOCK + order[slots % BLOCK]
        super().do_kv_cache_update(layer, key, value, kv_cache, moved_slots)


def cache(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=dtype)


def test_a_plain_copy_op_gets_strided_writes_that_leave_the_cache_as_the_op_does() -> None:
    layer = SimpleNamespace(impl=FakeImpl())
    paged = PagedLayout.probe(layer, cache(), DIM)
    assert paged.direct is not None
    # positions 2..17 over blocks 5, 1, 9, 3, 0: a partial block, whole ones, a partial one
    slots = torch.tensor([5 * BLOCK + 2, 5 * BLOCK + 3])
    slots = torch.cat([slots, *(torch.arange(BLOCK) + b * BLOCK for b in (1, 9, 3))])
    slots = torch.cat([slots, torch.arange(2)])
    keys, values = torch.randn(slots.numel(), HEADS, DIM), torch.randn(slots.numel(), HEADS, DIM)
    by_op, direct = cache(), cache()
    write(layer, by_op, slots, keys, values)
    paged.write(layer, direct, slots, keys, values)
    assert torch.equal(direct, by_op)


@pytest.mark.parametrize("impl", [Rounding(), Shuffled()], ids=["rounding", "shuffled"])
def test_an_op_that_is_no_plain_strided_copy_does_every_write(impl: FakeImpl) -> None:
    layer = SimpleNamespace(impl=impl)
    paged = PagedLayout.probe(layer, cache(), DIM)
    assert paged.direct is None
    slots = torch.arange(3 * BLOCK)
    keys, values = torch.randn(3 * BLOCK, HEADS, DIM), torch.randn(3 * BLOCK, HEADS, DIM)
    by_op, through = cache(), cache()
    write(layer, by_op, slots, keys, values)
    paged.write(layer, through, slots, keys, values)
    assert torch.equal(through, by_op)


def test_a_load_from_inside_a_block_writes_as_the_op_alone_would() -> None:
    store = MemoryKVStore()
    first, second = entry(list(range(1, 8))), entry(list(range(20, 31)))
    store.put(first)
    store.put(second)
    pieces = (PieceOp(0, 7, tuple(range(1, 8))), PieceOp(7, 10, tuple(range(20, 31))))
    op = LoadOp("r", (6, 2, 8, 4, 11), 3, 17, pieces)  # from position 3: inside block 6
    fast, slow = worker(store), worker(store)
    slow.paged = dataclasses.replace(slow._paged(), direct=None)
    assert fast._paged().direct is not None
    assert fast.load(op) == slow.load(op) == 14
    for index in range(2):
        assert torch.equal(fast.caches[index], slow.caches[index])


@pytest.mark.parametrize("precision", ["float16", "bfloat16", "int8"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_stored_forms_load_as_their_float_values_moved(
    precision: str, cache_dtype: torch.dtype
) -> None:
    store = MemoryKVStore()
    stored = entry([5, 6, 7, 8, 9, 99]).stored_as(precision)
    store.put(stored)
    side = worker(store)
    side.caches = {i: cache(cache_dtype) for i in side.caches}
    blocks = (3, 10)
    # positions 2..5 (vLLM computed 0..2) from the entry's rows 0..3: keys turned by 2
    assert side.load(LoadOp("r", blocks, 2, 5, (PieceOp(2, 3, (5, 6, 7, 8, 9, 99)),))) == 3
    want_keys, want_values = stored.dequantize(torch.float32)  # what was stored, as floats
    paged = side._paged()
    for index in range(2):
        keys, values = paged.read(side.caches[index], side.slots(blocks, 2, 5))
        want = moved(want_keys[index][:, :3], 2).to(cache_dtype).float()
        tolerance = 1e-5 if cache_dtype == torch.float32 else 1e-2
        torch.testing.assert_close(
            keys.transpose(0, 1).float(), want, rtol=tolerance, atol=tolerance
        )
        assert torch.equal(values.transpose(0, 1), want_values[index][:, :3].to(cache_dtype))


def test_a_disk_stores_entries_are_read_on_threads_and_a_corrupt_one_is_a_miss(
    tmp_path: Path,
) -> None:
    store = DiskKVStore(tmp_path)
    first, second, third = entry([1, 2, 3]), entry([4, 5, 6, 7]), entry([8, 9])
    for kv in (first, second, third):
        store.put(kv)
    path = next(tmp_path.glob(f"*/{second.key}.safetensors"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # a flipped payload byte: the integrity code fails
    path.write_bytes(bytes(data))
    side = worker(store)
    pieces = (PieceOp(0, 3, (1, 2, 3)), PieceOp(3, 4, (4, 5, 6, 7)), PieceOp(7, 2, (8, 9)))
    assert side.load(LoadOp("r", (5, 2, 7), 0, 9, pieces)) == 0  # fails in the first block
    assert side._readers is not None  # read on threads
    assert side.take_failed_loads() == {"r": 0}
    assert not store.contains(second.key)  # the bad entry is dropped: encoded again
    store.put(second)
    assert side.load(LoadOp("r", (5, 2, 7), 0, 9, pieces)) == 9
    paged = side._paged()
    keys, _ = paged.read(side.caches[1], side.slots((5, 2, 7), 0, 9))
    want = torch.cat(
        [moved(first.keys[1], 0), moved(second.keys[1], 3), moved(third.keys[1], 7)], 1
    )
    torch.testing.assert_close(keys.transpose(0, 1), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("to_host", [True, False])
def test_reading_whole_blocks_through_strides_reads_what_the_probe_map_reads(
    to_host: bool,
) -> None:
    """A blend reads a run's K/V back per layer: through the strided views where the
    layout is affine, each token exactly where the probed map says it is."""
    layer = SimpleNamespace(impl=FakeImpl())
    paged = PagedLayout.probe(layer, cache(), DIM)
    assert paged.direct is not None
    by_map = dataclasses.replace(paged, direct=None)
    kv = torch.randn(BLOCKS, HEADS, BLOCK, 2 * DIM)
    slots = torch.tensor([5 * BLOCK + 2, 5 * BLOCK + 3, 1 * BLOCK, 9 * BLOCK + 1, 3, 0])
    for a, b in zip(paged.read(kv, slots, to_host=to_host), by_map.read(kv, slots)):
        assert torch.equal(a, b)
