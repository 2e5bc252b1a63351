"""The ``kvrag`` command line without a model: entry point, argument checks, one-line errors.

Every check here fails (or succeeds) before any model is loaded; the commands
that ingest and answer are in tests/integration/test_cli.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import chromadb
import pytest

from kvrag_integrations.cli import main

ROOT = Path(__file__).resolve().parents[2]


def kvrag(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_entry_point_is_declared() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^kvrag = "kvrag_integrations\.cli:main"$', scripts, re.M)
    assert callable(main)


def test_module_runs_as_a_program(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "kvrag_integrations.cli", "store", "stats", "--store", "memory"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "entries 0" in done.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["ingest", "{tmp}/missing", "--collection", "docs"], "no such file or folder"),
        (["ingest", "{tmp}", "--collection", "docs"], "no .txt/.md/.markdown files"),
        (["store", "stats", "--store", "s3://bucket"], "unknown store URL"),
        (["ask", "q", "--collection", "docs", "--chroma", "{tmp}"], "does not exist"),
        (["ask", "q", "--collection", "docs", "--chroma", "{tmp}/none"], "no Chroma directory"),
        (["ask", "q", "--collection", "docs", "--strategy", "turbo", "--recompute-ratio", "0.2"],
         "applies to --strategy blend only"),
        (["store", "prune", "--store", "memory"], "needs at least one of"),
        (["ask", "q", "--collection", "docs", "--strategy", "fast"], "invalid choice"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line(capsys, tmp_path: Path, argv, message) -> None:
    code, _, err = kvrag(capsys, *(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert code == 2
    assert message in err and "Traceback" not in err
    if "invalid choice" not in message:  # argparse prints its usage first
        assert err.count("\n") == 1 and err.startswith("kvrag: error: ")


def test_empty_collection_exits_2(capsys, tmp_path: Path) -> None:
    chromadb.PersistentClient(str(tmp_path)).get_or_create_collection("empty")
    code, _, err = kvrag(capsys, "ask", "q", "--collection", "empty", "--chroma", str(tmp_path))
    assert code == 2 and "is empty" in err


def test_bench_forwards_its_arguments(capsys) -> None:
    code, out, _ = kvrag(capsys, "bench", "--help")
    assert code == 0 and "python -m kvrag_integrations.bench" in out and "--items" in out
    code, _, err = kvrag(capsys, "bench", "no-such-suite")
    assert code == 2 and "invalid choice" in err


SECRET_URL = "redis://user:secret@127.0.0.1:1/0"  # port 1: nothing listens there


@pytest.mark.parametrize(
    "argv",
    [
        ["store", "stats", "--store", SECRET_URL],
        ["store", "verify", "--store", SECRET_URL],
        ["store", "prune", "--store", SECRET_URL, "--max-bytes", "0"],
        ["store", "stats", "--store", "redis://user:secret@127.0.0.1:notaport/0"],
        ["store", "stats", "--store", "s3://user:secret@bucket"],
        ["store", "stats", "--store", "redis://127.0.0.1:1/0?password=secret"],
    ],
)
def test_store_urls_never_show_their_password(capsys, argv) -> None:
    """Failing to connect (or to parse) prints the error, never the credentials."""
    code, out, err = kvrag(capsys, *argv)
    assert code != 0 and err.startswith("kvrag: error: ")
    assert "secret" not in out + err


def test_ask_checks_its_arguments_before_loading_anything(capsys, tmp_path: Path) -> None:
    """A question that is not valid text (argv with bad bytes) is a one-line error."""
    code, _, err = kvrag(capsys, "ask", "when\udcff?", "--collection", "d", "--chroma", "/nope")
    assert code == 2 and "valid Unicode" in err and "Traceback" not in err
