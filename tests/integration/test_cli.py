"""The ``kvrag`` command line, run in-process with the session's shared model.

Ingest, ask and store commands on a real corpus, Chroma directory and disk
store (and a Redis server). Argument checks that load no model are in
tests/unit/test_cli_args.py.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import chromadb
import pytest

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.chunk_kv import ChunkKV, storage_fingerprint
from kvrag_integrations.cli import main
from kvrag_integrations.store import DiskKVStore

ROOT = Path(__file__).resolve().parents[2]
FILES = {
    "australia.md": "# Australia\n\nCanberra is the capital city of Australia. "
    "It was chosen in 1908 as a compromise between Sydney and Melbourne.\n",
    "canada.md": "# Canada\n\nOttawa is the capital of Canada. It lies on the Ottawa River.\n",
    "notes/nz.txt": "Wellington is the capital of New Zealand, on the North Island.\n",
    "notes/ignored.json": '{"not": "ingested"}\n',
    ".hidden/secret.md": "Hidden folders are skipped.\n",
}
QUESTION = "What is the capital of Australia?"
SUMMARY = re.compile(
    r"ingested (?P<files>\d+) files \((?P<new>\d+) new, (?P<changed>\d+) changed, "
    r"(?P<unchanged>\d+) unchanged, \d+ empty\) into '\w+': (?P<chunks>\d+) chunks, "
    r"(?P<tokens>\d+) tokens, (?P<caches>\d+) caches \((?P<written>\d+) written\), "
    r"(?P<size>[\d.]+ \w+) cached"
)


class Workspace:
    """A corpus folder, a Chroma directory and a disk store under one tmp dir."""

    def __init__(self, root: Path) -> None:
        self.corpus, self.chroma, self.kv = root / "corpus", root / "chroma", root / "kv"
        for name, text in FILES.items():
            (self.corpus / name).parent.mkdir(parents=True, exist_ok=True)
            (self.corpus / name).write_text(text)
        self.where = ["--collection", "docs", "--chroma", str(self.chroma)]
        self.store = ["--store", f"disk:{self.kv}"]

    def count(self) -> int:
        return chromadb.PersistentClient(str(self.chroma)).get_collection("docs").count()


def kvrag(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def ingest(capsys, ws: Workspace, *extra: str) -> dict[str, str]:
    code, out, err = kvrag(
        capsys, "ingest", str(ws.corpus), *ws.where, *ws.store, "--chunk-size", "64", *extra
    )
    assert code == 0, err
    match = SUMMARY.search(out)
    assert match, out
    return match.groupdict()


@pytest.fixture()
def ws(tmp_path: Path, engine: KVRAGEngine) -> Workspace:
    """A fresh workspace; ``engine`` makes sure the CLI reuses the session's weights."""
    return Workspace(tmp_path)


def test_ingest_then_ask_with_reuse(capsys, ws: Workspace, engine: KVRAGEngine) -> None:
    summary = ingest(capsys, ws, "--no-progress")
    assert summary["files"] == "3" and summary["new"] == "3"  # .json and hidden skipped
    chunks = int(summary["chunks"])
    assert chunks == ws.count() >= 3 and int(summary["tokens"]) > 20
    assert int(summary["written"]) == int(summary["caches"]) == len(DiskKVStore(ws.kv)) == chunks

    code, out, err = kvrag(
        capsys, "ask", QUESTION, *ws.where, *ws.store, "--strategy", "turbo",
        "--top-k", "2", "--max-new-tokens", "8",
    )  # fmt: skip
    assert code == 0, err
    assert out.strip()
    stats = re.search(r"TTFT (\d+) ms .* reused (\d+) tokens .* recomputed (\d+)", err)
    assert stats, err
    assert int(stats[2]) > 0 and int(stats[3]) == 0  # turbo reuses and recomputes nothing
    assert re.search(r"^retrieval \d+ ms$", err, re.M)  # every cache came from ingestion
    assert str(ws.corpus / "australia.md") in err.split("sources:")[1]  # the top source

    code, out, err = kvrag(
        capsys, "ask", QUESTION, *ws.where, *ws.store, "--strategy", "blend",
        "--recompute-ratio", "0.5", "--top-k", "2", "--max-new-tokens", "4",
    )  # fmt: skip
    assert code == 0, err
    stats = re.search(r"reused (\d+) tokens .* recomputed (\d+)", err)
    assert stats and int(stats[1]) > 0 and int(stats[2]) > 0, err


def test_reingest_is_idempotent_and_replaces_changed_files(capsys, ws: Workspace) -> None:
    first = ingest(capsys, ws)
    keys = sorted(DiskKVStore(ws.kv).keys())

    again = ingest(capsys, ws)
    assert (again["new"], again["changed"], again["unchanged"]) == ("0", "0", "3")
    assert again["written"] == "0" and again["chunks"] == first["chunks"]
    assert ws.count() == int(first["chunks"]) and sorted(DiskKVStore(ws.kv).keys()) == keys

    (ws.corpus / "canada.md").write_text("Ottawa is the capital of Canada.\n")
    changed = ingest(capsys, ws)
    assert (changed["new"], changed["changed"], changed["unchanged"]) == ("0", "1", "2")
    assert changed["written"] == "1"  # only the new chunk is encoded
    assert ws.count() == int(changed["chunks"])  # the old chunks of canada.md are gone
    docs = chromadb.PersistentClient(str(ws.chroma)).get_collection("docs").get()["documents"]
    assert "Ottawa is the capital of Canada." in docs and not any("River" in d for d in docs)


def test_store_stats_verify_and_prune(capsys, ws: Workspace, engine: KVRAGEngine) -> None:
    chunks = int(ingest(capsys, ws, "--no-progress")["chunks"])
    store = DiskKVStore(ws.kv)
    fingerprint = storage_fingerprint(engine.loaded.fingerprint, "float16")  # the CLI's default
    mine = store.get(next(store.keys()), fingerprint)
    foreign = ChunkKV(mine.token_ids, mine.keys, mine.values, "another-model")
    store.put(foreign)

    code, out, _ = kvrag(capsys, "store", "stats", *ws.store)
    assert code == 0 and f"entries {chunks + 1}" in out
    assert f"fingerprint {fingerprint}: {chunks}" in out
    assert "fingerprint another-model: 1" in out

    victim = next(k for k in list(store.keys()) if k != foreign.key)
    path = ws.kv / victim[:2] / f"{victim}.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    code, out, _ = kvrag(capsys, "store", "verify", *ws.store)
    assert code == 1 and f"corrupt {victim}" in out and "1 corrupt" in out and path.exists()
    code, out, _ = kvrag(capsys, "store", "verify", *ws.store, "--delete")
    assert code == 0 and "1 deleted" in out and not path.exists()
    code, out, _ = kvrag(capsys, "store", "verify", *ws.store)
    assert code == 0 and f"{chunks} ok, 0 corrupt" in out

    code, out, _ = kvrag(capsys, "store", "prune", *ws.store, "--foreign")
    assert code == 0 and "evicted 1 entries" in out and not store.contains(foreign.key)
    assert len(store) == chunks - 1

    old = next(iter(store.keys()))
    stamp = time.time() - 3 * 86400
    os.utime(ws.kv / old[:2] / f"{old}.safetensors", (stamp, stamp))
    code, out, _ = kvrag(capsys, "store", "prune", *ws.store, "--older-than", "2", "--dry-run")
    assert code == 0 and "would evict 1 entries" in out and store.contains(old)
    code, out, _ = kvrag(capsys, "store", "prune", *ws.store, "--older-than", "2")
    assert code == 0 and not store.contains(old) and len(store) == chunks - 2

    code, out, _ = kvrag(capsys, "store", "prune", *ws.store, "--max-bytes", "0")
    assert code == 0 and len(store) == 0 and "0 entries remain" in out


def test_store_stats_prints_a_redacted_url(capsys, tmp_path: Path) -> None:
    """A server with a password: stats succeeds and prints the URL without it."""
    import shutil

    import redis

    from kvrag_integrations.bench.memory import redis_server

    if (binary := shutil.which("redis-server")) is None:
        pytest.skip("redis-server not found (apt-get install redis-server)")
    with redis_server(binary, tmp_path) as plain_url:
        redis.Redis.from_url(plain_url).config_set("requirepass", "secret")
        url = plain_url.replace("redis://", "redis://default:secret@")
        code, out, err = kvrag(capsys, "store", "stats", "--store", url)
        assert code == 0, err
        assert "entries 0" in out and "redis://***@127.0.0.1:" in out
        assert "secret" not in out + err


def test_calibrate_records_a_choice_every_engine_on_the_store_reads(
    capsys, ws: Workspace, engine: KVRAGEngine
) -> None:
    """``kvrag calibrate`` on the chunks ingested into a store: the candidates are
    measured against full prefill, the choice is recorded in the store, and an engine
    made afterwards on that store (another process would be the same: the record is a
    file there) blends with it."""
    assert kvrag(capsys, "ingest", str(ws.corpus), *ws.where, *ws.store)[0] == 0
    code, out, _ = kvrag(
        capsys,
        "calibrate",
        *ws.store,
        "--prompts", "2",
        "--chunks-per-prompt", "3",
        "--contexts", "alone",
        "--selections", "query",
        "--recompute-first", "0",
        "--ratios", "0.5,1.0",
    )  # fmt: skip
    assert code == 0, out
    assert "chosen for" in out and "blend@" in out
    fresh = KVRAGEngine(engine.loaded, store=DiskKVStore(ws.kv))
    calibration = fresh.calibrations.current()
    assert calibration is not None and calibration.identity == fresh.calibrations.identity
    # the bundled choice (MuSiQue's ~64-token chunks) stays beside this one
    (choice,) = [c for c in calibration.choices if c.prompts == 2]
    assert choice.settings.selection == "query" and choice.settings.chunk_context == "alone"
    assert choice.settings.recompute_ratio in (0.5, 1.0)
    assert any((ws.kv / "_records").iterdir())
