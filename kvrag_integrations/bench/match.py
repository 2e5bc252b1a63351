"""The content index (``kvrag_integrations.matching``): cover time, build, replay, memory.

No model: entries are random token ids (seeded, vocabulary 49,152), 150 to
250 ids each, like stored chunks. The suite indexes ``n_chunks`` of them one
``add`` at a time (as a server learns them), then covers ``repeats`` prompts of
4,096 ids, each holding 4 of the entries (one with its first 2 ids changed)
apart from one another by 1 to 16 ids of glue, amid unknown ids: the median
and p95 of ``cover`` (after a warm-up), and whether every embedded entry's run
was found. Then the restart: the same entries appended to a ``DiskIndexLog``,
and the time a fresh ``SyncedIndex`` takes to replay that log. Memory is the
process's resident set (VmRSS) growth over each build, with the index's own
numpy bytes beside it.

Examples:
    python -m kvrag_integrations.bench match --out /tmp/bench-match
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvrag_integrations.bench.common import markdown_table
from kvrag_integrations.matching import ContentIndex, DiskIndexLog, SyncedIndex

QUICK = {"n_chunks": 2000, "repeats": 20}
VOCAB = 49152
NAMESPACE = "bench-model"


def rss_mb() -> float | None:
    """This process's resident set, in MB (None where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _growth(before: float | None) -> float | None:
    after = rss_mb()
    return None if before is None or after is None else round(after - before, 1)


def make_entries(n: int, seed: int) -> list[np.ndarray]:
    """``n`` random entries of 150 to 250 ids (views into one buffer)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(150, 251, n)
    flat = rng.integers(0, VOCAB, int(lengths.sum()), dtype=np.int32)
    return np.split(flat, np.cumsum(lengths)[:-1])


def make_prompt(
    rng: np.random.Generator, entries: list[np.ndarray], tokens: int
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """A prompt of ``tokens`` ids holding 4 entries, and what must be found:
    ``(entry number, prompt start, entry offset)`` of each."""
    chosen = rng.choice(len(entries), 4, replace=False)
    parts = [rng.integers(0, VOCAB, int(rng.integers(50, 400)))]  # unknown head
    expected, at = [], len(parts[0])
    for j, number in enumerate(chosen):
        piece = entries[number].copy()
        skip = 2 if j == 1 else 0
        if skip:  # edge ids differ from the stored ones: found from offset 2
            piece[:skip] = (piece[:skip] + 1) % VOCAB
        expected.append((int(number), at + skip, skip))
        glue = rng.integers(0, VOCAB, int(rng.integers(1, 17)))
        parts += [piece, glue]
        at += len(piece) + len(glue)
    parts.append(rng.integers(0, VOCAB, max(0, tokens - at)))
    return np.concatenate(parts)[:tokens].tolist(), expected


def run(
    engine: Any = None,
    items: Any = None,
    *,
    n_chunks: int = 100_000,
    repeats: int = 200,
    prompt_tokens: int = 4096,
    seed: int = 0,
) -> dict[str, Any]:
    """The figures above; ``n_chunks`` entries, ``repeats`` prompts (``engine`` and
    ``items`` are not used: the suite needs no model)."""
    entries = make_entries(n_chunks, seed)
    gc.collect()
    before = rss_mb()
    index = ContentIndex()
    started = time.perf_counter()
    for entry in entries:
        index.add(NAMESPACE, entry)
    index.flush()
    build_s = time.perf_counter() - started
    rss_build = _growth(before)

    rng = np.random.default_rng(seed + 1)
    prompts = [make_prompt(rng, entries, prompt_tokens) for _ in range(repeats)]
    for prompt, _ in prompts[:10]:  # warm-up
        index.cover(NAMESPACE, prompt)
    gc.collect()
    times, covers = [], []
    for prompt, _ in prompts:  # timed alone: checking makes garbage (gc pauses)
        start = time.perf_counter()
        covers.append(index.cover(NAMESPACE, prompt))
        times.append(time.perf_counter() - start)
    found = expected = 0
    for (_, want), runs in zip(prompts, covers):
        got = {(r.entry, r.start, r.offset) for r in runs}
        expected += len(want)
        found += sum((tuple(entries[e].tolist()), s, o) in got for e, s, o in want)
    times_ms = sorted(t * 1e3 for t in times)

    with tempfile.TemporaryDirectory(prefix="kvrag-bench-match-") as tmp:
        log = DiskIndexLog(tmp)
        started = time.perf_counter()
        for entry in entries:
            log.append(NAMESPACE, entry)
        append_s = time.perf_counter() - started
        log.close()
        log_bytes = log.path.stat().st_size
        del index
        gc.collect()
        before = rss_mb()
        started = time.perf_counter()
        replayed = SyncedIndex(DiskIndexLog(tmp))
        replayed.refresh()
        replay_s = time.perf_counter() - started
        rss_replay = _growth(before)
        replayed_entries, index_bytes = len(replayed), replayed.index.nbytes
        replayed.close()
    return {
        "entries": n_chunks,
        "entry_tokens": "150-250",
        "vocab": VOCAB,
        "prompt_tokens": prompt_tokens,
        "prompts": repeats,
        "cover_ms_median": statistics.median(times_ms),
        "cover_ms_p95": times_ms[min(len(times_ms) - 1, int(0.95 * len(times_ms)))],
        "cover_ms_max": times_ms[-1],
        "runs_found": found,
        "runs_expected": expected,
        "build_s": build_s,
        "rss_build_mb": rss_build,
        "index_mb": index_bytes / 1e6,
        "log_append_s": append_s,
        "log_mb": log_bytes / 1e6,
        "replay_s": replay_s,
        "replayed_entries": replayed_entries,
        "rss_replay_mb": rss_replay,
    }


def table(payload: dict[str, Any]) -> str:
    """One row of figures."""
    headers = [
        "entries",
        "cover median (ms)",
        "cover p95 (ms)",
        "runs found",
        "build, add by add (s)",
        "log replay (s)",
        "RSS growth (MB)",
        "index arrays (MB)",
        "log (MB)",
    ]
    row = [
        payload["entries"],
        payload["cover_ms_median"],
        payload["cover_ms_p95"],
        f"{payload['runs_found']}/{payload['runs_expected']}",
        payload["build_s"],
        payload["replay_s"],
        payload["rss_build_mb"],
        payload["index_mb"],
        payload["log_mb"],
    ]
    return "\n".join(
        [
            markdown_table(headers, [row]),
            "",
            f"`cover` of {payload['prompts']} prompts of {payload['prompt_tokens']} ids "
            "(4 entries each, one with its first 2 ids changed, amid unknown ids); "
            "entries of 150-250 random ids; replay: a fresh SyncedIndex reading a "
            "DiskIndexLog of the same entries.",
        ]
    )
