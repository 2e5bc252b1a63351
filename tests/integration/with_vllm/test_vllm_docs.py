"""The docs that start vLLM run as written: the cookbook notebooks on a vLLM server
(05) on the run's ``README_SERVER`` (given as ``$KVRAG_SERVER_URL``), and
docs/vllm.md's examples, which start their own (``VLLMEngine.from_pretrained``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cookbook import NOTEBOOKS, execute, runs_on_vllm
from test_docs import NEEDS_VLLM, ROOT, run_blocks
from vllm_helpers import README_SERVER, VLLMServer, needs_vllm

needs_vllm()

pytestmark = pytest.mark.vllm_server(*README_SERVER)  # (the notebooks')


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if runs_on_vllm(p)], ids=lambda p: p.stem)
def test_notebook_runs(
    path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    vllm_server: VLLMServer,
) -> None:
    monkeypatch.setenv("KVRAG_SERVER_URL", vllm_server.url)
    execute(path, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.starts_vllm(n)) for name, n in NEEDS_VLLM.items()]
)
def test_code_blocks_run(name: str, tmp_path: Path) -> None:
    run_blocks(ROOT / "docs" / name, tmp_path)
