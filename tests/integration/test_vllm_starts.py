"""The count of vLLM starts (vllm_starts.py) finds engine cores nobody declared.

A process titled as vLLM's engine core (``VLLM::EngineCore``, set with prctl as
vLLM's setproctitle does) stands in for a vLLM: started by a shell, as a server
starts its engine core, so it is a grandchild of the test process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from vllm_starts import MAX_STARTS, VLLMStarts

# until its stdin closes
FAKE_CORE = (
    "import ctypes, sys; ctypes.CDLL(None).prctl(15, b'VLLM::EngineCore', 0, 0, 0); "
    "print('up', flush=True); sys.stdin.read()"
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs /proc")


@pytest.mark.starts_vllm(1)  # (its stand-in, which the run's own count sees too)
def test_an_engine_core_nobody_declared_fails_the_run_as_do_too_many() -> None:
    starts = VLLMStarts()
    assert starts.scan() == 0 and starts.problems() == []
    command = f'{sys.executable} -c "{FAKE_CORE}"; exit 0'  # a shell that waits: a grandchild
    shell = subprocess.Popen(
        ["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert shell.stdout is not None and shell.stdout.readline() == "up\n"
        assert starts.scan() == 1
        assert "starts vLLM without the fixtures" in " ".join(starts.problems())
        starts.declare("a fixture")
        assert starts.problems() == []
        starts.declare("the rest", MAX_STARTS)
        assert "more than MAX_STARTS" in " ".join(starts.problems())
    finally:
        shell.communicate(timeout=30)  # its stdin closed: the stand-in ends, then the shell


def test_a_watcher_that_never_sees_a_confirmed_start_says_it_is_blind() -> None:
    starts = VLLMStarts(root=-1)  # no process descends from it
    starts.declare("vllm_engine")
    starts.confirm()  # its scan finds nothing: not confirmed
    assert starts.confirmed == 0 and starts.problems() == []
    starts.confirmed = 1  # as if a scan had found it once, and the watcher never did
    assert "the watcher is blind" in " ".join(starts.problems())
