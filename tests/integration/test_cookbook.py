"""Every cookbook notebook runs top to bottom on the default CPU model (those on a
vLLM server in with_vllm/test_vllm_docs.py, the vLLM lane's).

Each notebook is executed with nbclient in a fresh ``python3`` kernel (ipykernel),
in a temporary working directory, with a timeout per cell. The kernel imports
``kvrag_integrations`` from this checkout (the repository root is put first on
``PYTHONPATH``). A cell that raises fails the test, so a broken notebook fails the
build.

``KVRAG_COOKBOOK_SAVE=1 python -m pytest tests/integration/test_cookbook.py`` also writes the
executed notebooks (with their outputs) back to ``cookbook/``; that is how the
committed outputs are made.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "cookbook").glob("*.ipynb"))
CELL_TIMEOUT_S = 600


def _kernel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel inherits this process's environment: offline, quiet, sane threads."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), path) if p))
    # ipykernel's spec starts `python`: make it this interpreter.
    monkeypatch.setenv(
        "PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ANONYMIZED_TELEMETRY", "False")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # Respect a caller's choice; otherwise a few threads (not every core of a CI box).
    threads = os.environ.get("OMP_NUM_THREADS") or str(min(4, os.cpu_count() or 1))
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    monkeypatch.setenv("MKL_NUM_THREADS", threads)


def _tidy(nb: nbformat.NotebookNode) -> None:
    """Merge streamed pieces into one output per stream (as Jupyter shows them) and
    drop per-run metadata, so saved notebooks stay small and differ only in outputs."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        merged: list[nbformat.NotebookNode] = []
        for out in cell.get("outputs", []):
            last = merged[-1] if merged else None
            if (
                last is not None
                and out.output_type == "stream"
                and last.output_type == "stream"
                and last.name == out.name
            ):
                last.text += out.text
            else:
                merged.append(out)
        if "outputs" in cell:
            cell.outputs = merged


def runs_on_vllm(path: Path) -> bool:
    """A notebook that runs on a vLLM server: with_vllm/test_vllm_docs.py runs it (the
    vLLM lane), on the run's server."""
    return nbformat.read(path, as_version=4).metadata.get("kvrag", {}).get("requires") == "vllm"


def test_notebooks_found() -> None:
    assert [p.name[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04", "05", "06"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "path", [p for p in NOTEBOOKS if not runs_on_vllm(p)], ids=lambda p: p.stem
)
def test_notebook_runs(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    execute(path, tmp_path, monkeypatch, capsys)


def execute(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Run the notebook top to bottom in a fresh kernel in ``tmp_path``; fail on an error."""
    nb = nbformat.read(path, as_version=4)
    _kernel_env(monkeypatch)
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
        record_timing=False,
    )
    started = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    wall_s = time.perf_counter() - started

    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors
    with capsys.disabled():
        print(f"\n{path.name}: executed in {wall_s:.1f} s")
    if os.environ.get("KVRAG_COOKBOOK_SAVE") == "1":
        _tidy(nb)
        nbformat.write(nb, path)
