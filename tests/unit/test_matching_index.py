"""ContentIndex: maximal runs at any offset of any entry, and the greedy cover."""

from __future__ import annotations

import numpy as np
import pytest

from kvrag_integrations.matching import ContentIndex, Run, hashing, table
from kvrag_integrations.matching.runs import greedy_cover

VOCAB = 49152


def ids(seed: int, n: int, vocab: int = VOCAB) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def check(prompt: list[int], runs: list[Run]) -> None:
    """Pieces are sorted, apart, non-empty, and what they claim, id for id."""
    end = 0
    for r in runs:
        assert r.start >= end and r.length >= 1
        assert prompt[r.start : r.end] == list(r.entry[r.offset : r.offset + r.length])
        end = r.end


def spans(runs: list[Run]) -> list[tuple[int, int, int]]:
    return [(r.start, r.length, r.offset) for r in runs]


def test_a_run_at_any_offset_is_found_and_extended_both_ways() -> None:
    index, entry = ContentIndex(), ids(1, 120)
    assert index.add("m", entry)
    for cut in (0, 1, 7, 13, 40):
        prompt = ids(2, 9) + entry[cut : cut + 67] + ids(3, 5)
        runs = index.cover("m", prompt)
        check(prompt, runs)
        assert spans(runs) == [(9, 67, cut)] and runs[0].entry == tuple(entry)


def test_reordered_entries_with_glue_and_changed_edges() -> None:
    index = ContentIndex()
    a, b, c = ids(10, 150), ids(11, 200), ids(12, 180)
    for entry in (a, b, c):
        index.add("m", entry)
    b_changed = [1, 2, *b[2:-3], 3, 4, 5]  # edge tokens differ from the stored ones
    prompt = ids(13, 40) + c + [7, 8] + a + [9] + b_changed + ids(14, 30)
    runs = index.cover("m", prompt)
    check(prompt, runs)
    assert [r.entry for r in runs] == [tuple(c), tuple(a), tuple(b)]
    assert spans(runs) == [(40, 180, 0), (222, 150, 0), (375, 195, 2)]


def test_short_runs_are_not_reported_but_min_run_is() -> None:
    index, entry = ContentIndex(), ids(20, 100)
    index.add("m", entry)
    assert index.cover("m", ids(21, 10) + entry[30:45] + ids(22, 10)) == []
    prompt = ids(21, 10) + entry[30:46] + ids(22, 10)
    assert spans(index.cover("m", prompt)) == [(10, 16, 30)]


def test_the_greedy_cover_prefers_the_furthest_reach_then_trims() -> None:
    text = ids(30, 200)
    index = ContentIndex()
    index.add("m", text[0:60])  # covers prompt [0, 60)
    index.add("m", text[0:40])  # starts at 0 too but ends sooner: never chosen
    index.add("m", text[50:70])  # covers [50, 70): trimmed to [60, 70)
    index.add("m", text[55:150])  # covers [55, 150): reaches further than [50, 70)
    runs = index.cover("m", text[:150])
    check(text[:150], runs)
    assert [(r.start, r.length, r.offset, len(r.entry)) for r in runs] == [
        (0, 60, 0, 60),
        (60, 90, 5, 95),
    ]
    index.remove("m", text[55:150])
    runs = index.cover("m", text[:150])
    assert [(r.start, r.length, r.offset) for r in runs] == [(0, 60, 0), (60, 10, 10)]


def test_gaps_are_left_where_nothing_matches() -> None:
    index, a, b = ContentIndex(), ids(40, 50), ids(41, 50)
    index.add("m", a)
    index.add("m", b)
    prompt = ids(42, 20) + a + ids(43, 33) + b
    assert spans(index.cover("m", prompt)) == [(20, 50, 0), (103, 50, 0)]


@pytest.mark.parametrize("first", [0, 1])
def test_ties_go_to_the_earliest_added_entry(first: int) -> None:
    shared = ids(50, 50)
    entries = [shared + ids(51, 30), ids(52, 30) + shared]
    index = ContentIndex()
    index.add("m", entries[first])
    index.add("m", entries[1 - first])
    runs = index.cover("m", ids(53, 5) + shared + ids(54, 5))
    assert len(runs) == 1 and runs[0].entry == tuple(entries[first])
    # Deterministic: the same again, and the same from an index built the same way.
    again = ContentIndex()
    again.add("m", entries[first])
    again.add("m", entries[1 - first])
    assert again.cover("m", ids(53, 5) + shared + ids(54, 5)) == runs


def test_namespaces_never_match_each_other() -> None:
    index, entry = ContentIndex(), ids(60, 80)
    assert index.add("model-a", entry) and index.add("model-b", entry)
    assert not index.add("model-a", entry)
    assert ("model-a", entry) in index and ("model-c", entry) not in index
    index.remove("model-a", entry)
    assert index.cover("model-a", entry) == [] and index.cover("model-c", entry) == []
    assert spans(index.cover("model-b", entry)) == [(0, 80, 0)]


def test_a_constant_hash_costs_time_never_a_wrong_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every k-gram and every namespace collides: results equal the real hash's."""
    entries = [ids(70 + i, 60 + 7 * i, vocab=50) for i in range(8)]
    prompt = ids(90, 30, vocab=50) + entries[3][5:50] + entries[6] + entries[0][:4] + [1]

    def build() -> ContentIndex:
        index = ContentIndex(max_hits=10**6)
        for i, entry in enumerate(entries):
            index.add("m" if i % 2 else "other", entry)
        return index

    want = build().cover("m", prompt)
    assert [r.entry for r in want] == [tuple(entries[3])]  # entries[6] is in "other"
    check(prompt, want)
    other = build().cover("other", prompt)
    assert spans(other) == [(75, len(entries[6]), 0)]

    def constant(ids: np.ndarray, k: int, starts: np.ndarray | None = None) -> np.ndarray:
        n = len(starts) if starts is not None else max(0, len(ids) - k + 1)
        return np.zeros(n, np.uint64)

    monkeypatch.setattr(hashing, "kgram_hashes", constant)
    monkeypatch.setattr(hashing, "namespace_salt", lambda namespace: np.uint64(0))
    index = build()
    got = index.cover("m", prompt)
    check(prompt, got)
    assert got == want
    assert index.cover("other", prompt) == other


def brute_runs(entries: list[list[int]], prompt: list[int], min_run: int) -> set:
    """Every maximal common run of length >= min_run, by comparing all diagonals."""
    found = set()
    for number, entry in enumerate(entries):
        for diagonal in range(-len(entry) + 1, len(prompt)):
            p = max(0, diagonal)
            run = 0
            while p <= len(prompt):
                same = p < len(prompt) and 0 <= p - diagonal < len(entry)
                if same and prompt[p] == entry[p - diagonal]:
                    run += 1
                else:
                    if run >= min_run:
                        found.add((p - run, run, number, p - run - diagonal))
                    run = 0
                    if p - diagonal >= len(entry):
                        break
                p += 1
    return found


@pytest.mark.parametrize("min_head", [2, 100])
@pytest.mark.parametrize("seed", range(6))
def test_matches_a_brute_force_cover_on_repetitive_ids(seed: int, min_head: int) -> None:
    """Vocabulary of 3: runs everywhere, on many diagonals, overlapping."""
    rng = np.random.default_rng(seed)
    entries = [rng.integers(0, 3, rng.integers(1, 40)).tolist() for _ in range(12)]
    prompt = rng.integers(0, 3, 120).tolist()
    index = ContentIndex(min_run=6, min_head=min_head, max_hits=10**6, max_period=0)
    unique = [entry for entry in entries if index.add("m", entry)]
    runs = brute_runs(unique, prompt, 1)
    runs = {r for r in runs if r[1] >= 6 or (r[0] == 0 and r[3] == 0 and r[1] >= min_head)}
    want = greedy_cover(sorted(runs))
    got = index.cover("m", prompt)
    check(prompt, got)
    assert [(r.start, r.length, r.entry, r.offset) for r in got] == [
        (s, n, tuple(unique[e]), o) for s, n, e, o in want
    ]


def test_rows_move_through_every_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny merge thresholds: pending rows, the delta tier and main all answer."""
    monkeypatch.setattr(table, "_DELTA_MIN", 8)
    index = ContentIndex()
    entries = [ids(600 + i, 40) for i in range(120)]
    for i, entry in enumerate(entries):
        index.add("m", entry)
        if i % 5 == 0:
            seen = entries[: i + 1 : 7]
            prompt = [x for e in seen for x in e]
            assert [r.entry for r in index.cover("m", prompt)] == [tuple(e) for e in seen]


def test_min_head_counts_a_short_run_only_at_prompt_and_entry_start() -> None:
    index, entry = ContentIndex(), [5, 6, 7, 8, 9, 10, *ids(80, 50)]
    index.add("m", entry)
    assert spans(index.cover("m", [5, 6, 7, 8, 9, 99, 98])) == [(0, 5, 0)]
    assert index.cover("m", [5, 6, 7, 99, 98]) == []  # 3 < min_head
    assert index.cover("m", [1, 5, 6, 7, 8, 9, 99]) == []  # not at the prompt's start
    assert index.cover("m", [6, 7, 8, 9, 10, 99]) == []  # not at the entry's start
    glue = [1, 2, 3, 4]  # a glue entry: shorter than k, found by its head
    index.add("m", glue)
    runs = index.cover("m", [*glue, 50, 51])
    assert spans(runs) == [(0, 4, 0)] and runs[0].entry == tuple(glue)


def test_popular_kgrams_are_capped_and_unique_parts_still_found() -> None:
    """200 entries share a 40-id template; only 8 are tried per position, yet the
    entry whose own part follows is found, its run reaching back over the template."""
    template = ids(100, 40)
    entries = [template + ids(200 + i, 30) for i in range(200)]
    index = ContentIndex(max_hits=8)
    assert index.add_many(("m", e) for e in entries) == 200
    runs = index.cover("m", entries[150] + ids(99, 10))
    assert len(runs) == 1 and runs[0].entry == tuple(entries[150])
    assert spans(runs) == [(0, 70, 0)]
    runs = index.cover("m", template + ids(98, 10))
    assert spans(runs) == [(0, 40, 0)] and runs[0].entry == tuple(entries[0])


def test_repetitive_stretches_stay_cheap_and_runs_cross_them() -> None:
    """A prompt of one id repeated, against entries full of it: no diagonal per
    position; a run holding other ids is still found and extended through it."""
    index = ContentIndex()
    noisy = [ids(700 + i, 20) + [220] * 150 + ids(800 + i, 20) for i in range(100)]
    index.add_many(("m", e) for e in noisy)
    plain_run = [9] * 40  # only repetitive k-grams: not indexed, never found
    index.add("m", plain_run)
    assert index.cover("m", ids(1, 5) + [220] * 2000) == []
    assert index.cover("m", ids(1, 5) + plain_run) == []
    prompt = [220] * 300 + noisy[42][:100] + [3, 4]  # the stretch before: not matched
    runs = index.cover("m", prompt)
    check(prompt, runs)
    assert spans(runs) == [(300, 100, 0)] and runs[0].entry == tuple(noisy[42])
    prompt = [3, *noisy[42][5:], 4]  # found from the ids around the stretch, across it
    runs = index.cover("m", prompt)
    assert spans(runs) == [(1, 185, 5)] and runs[0].entry == tuple(noisy[42])
    exact = ContentIndex(max_period=0)
    exact.add("m", plain_run)
    assert spans(exact.cover("m", ids(1, 5) + plain_run)) == [(5, 40, 0)]


def test_adds_between_covers_are_seen_at_once() -> None:
    index = ContentIndex()
    entries = [ids(300 + i, 32) for i in range(300)]
    for i, entry in enumerate(entries):
        index.add("m", entry)
        if i % 37 == 0:  # lookups merge the new rows in, small and large
            assert index.cover("m", entry)[0].entry == tuple(entry)
    for entry in entries[::29]:
        assert spans(index.cover("m", [1, *entry])) == [(1, 32, 0)]
    assert len(index) == 300 and index.nbytes > 300 * 32 * 4


def test_remove_and_compact_keep_the_others_and_their_order() -> None:
    shared = ids(400, 50)
    first, second, third = [*shared, 1], [2, *shared], ids(401, 40)
    index = ContentIndex()
    for entry in (first, second, third):
        index.add("m", entry)
    assert index.remove("m", first) and not index.remove("m", first)
    assert not index.remove("nowhere", first)
    assert (("m", first) not in index) and len(index) == 2
    assert index.cover("m", shared)[0].entry == tuple(second)
    index.add("m", first)  # back, now the newest: ties go to ``second``
    index.compact()
    assert len(index) == 3 and index.cover("m", shared)[0].entry == tuple(second)
    assert spans(index.cover("m", third)) == [(0, 40, 0)]


def test_bad_input_is_refused() -> None:
    index = ContentIndex()
    for bad in ([], [-1, 2], [1.5, 2.0], [[1, 2]], [2**31]):
        with pytest.raises(ValueError):
            index.add("m", bad)
    with pytest.raises(TypeError):
        index.add(3, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        index.cover("m", [[1, 2]])
    assert index.cover("m", []) == [] and len(index) == 0
    index.add("m", ids(500, 30))
    assert index.cover("m", np.array([2**40, -3] * 20)) == []  # never stored: no match


def test_the_matching_package_imports_neither_torch_nor_vllm() -> None:
    """Only numpy and the standard library (the store, lazily, to open a URL's log)."""
    import ast
    import sys
    from pathlib import Path

    import kvrag_integrations.matching as package

    ours = ("kvrag_integrations.matching", "kvrag_integrations.store")
    for path in Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert (
                    top in {"numpy", "__future__"}
                    or top in sys.stdlib_module_names
                    or (name.startswith(ours))
                ), f"{path.name} imports {name}"
