"""keep_freed_memory: glibc keeps freed prompt caches for the next request on CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvrag_integrations.engine.modeling import host_memory
from kvrag_integrations.engine.modeling import model as model_module

glibc_only = pytest.mark.skipif(host_memory._libc() is None, reason="needs glibc")

_SETTINGS_ENV = (
    host_memory.OPT_OUT_ENV,
    *host_memory.MALLOC_ENV,
    "GLIBC_TUNABLES",
    "LD_PRELOAD",
)


class Recorder:
    """Stands in for libc's mallopt: records its arguments, answers 1 (success)."""

    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


@pytest.fixture
def mallopt(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """A clean environment, the module's once-flag reset and mallopt recorded."""
    if host_memory._libc() is None:
        pytest.skip("needs glibc")
    for name in _SETTINGS_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(host_memory, "_applied", False)
    recorder = Recorder()
    monkeypatch.setattr(host_memory._libc(), "mallopt", recorder)
    return recorder


def test_sets_the_documented_thresholds_once(mallopt: Recorder) -> None:
    assert host_memory.keep_freed_memory() is True
    assert mallopt.calls == [(-3, 32 * 1024 * 1024), (-1, 1024 * 1024 * 1024)]
    assert host_memory.keep_freed_memory() is True
    assert len(mallopt.calls) == 2


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KVRAG_KEEP_FREED_MEMORY", "0"),
        ("KVRAG_KEEP_FREED_MEMORY", "false"),
        ("KVRAG_KEEP_FREED_MEMORY", "False"),
        ("MALLOC_MMAP_THRESHOLD_", "131072"),
        ("MALLOC_TRIM_THRESHOLD_", "0"),
        ("MALLOC_TOP_PAD_", "0"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
        ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
        ("LD_PRELOAD", "libfoo.so:/opt/lib/libtcmalloc_minimal.so.4"),
    ],
)
def test_skipped_when_the_user_chose(
    mallopt: Recorder, monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    assert host_memory.keep_freed_memory() is False
    assert mallopt.calls == []
    assert host_memory._applied is False


@pytest.mark.parametrize("value", ["1", "true", ""])
def test_other_opt_out_values_keep_it_on(
    mallopt: Recorder, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("KVRAG_KEEP_FREED_MEMORY", value)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F")  # not malloc's
    monkeypatch.setenv("LD_PRELOAD", "libfoo.so")
    assert host_memory.keep_freed_memory() is True
    assert len(mallopt.calls) == 2


def test_skipped_without_glibc(mallopt: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "_libc", lambda: None)
    assert host_memory.keep_freed_memory() is False
    assert mallopt.calls == []


def test_refused_mallopt_is_not_applied(mallopt: Recorder) -> None:
    mallopt.answer = 0
    assert host_memory.keep_freed_memory() is False
    assert host_memory._applied is False


@pytest.mark.parametrize(("device", "calls"), [("cpu", 1), ("cuda", 0)])
def test_load_model_applies_it_on_cpu_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path, device: str, calls: int
) -> None:
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")  # restored after the test
    called: list[None] = []
    monkeypatch.setattr(model_module, "keep_freed_memory", lambda: called.append(None))
    with pytest.raises(FileNotFoundError):  # stops right after the device settings
        model_module.load_model(tmp_path / "missing.gguf", device=device, dtype="float32")
    assert len(called) == calls


# A fresh process (this one's malloc state is left alone): 32 blocks of 3 MiB,
# the size of a prompt cache's per-layer tensors, allocated and freed; glibc's
# mallinfo2 then says how much freed memory the process kept.
_PROBE = textwrap.dedent(
    """
    import ctypes, importlib.util, sys

    spec = importlib.util.spec_from_file_location("host_memory", sys.argv[1])
    host_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_memory)
    applied = [host_memory.keep_freed_memory(), host_memory.keep_freed_memory()]

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = Mallinfo2
    blocks = [libc.malloc(3 << 20) for _ in range(32)]
    for block in blocks:
        libc.free(block)
    print(applied[0], applied[1], libc.mallinfo2().fordblks >> 20)
    """
)


def _probe(**env: str) -> tuple[str, str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in _SETTINGS_ENV}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, host_memory.__file__],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    return out[0], out[1], int(out[2])


@glibc_only
@pytest.mark.skipif(
    not hasattr(host_memory._libc(), "mallinfo2"), reason="mallinfo2 needs glibc >= 2.33"
)
def test_freed_memory_stays_in_the_process() -> None:
    first, again, kept_mib = _probe()
    assert (first, again) == ("True", "True")
    assert kept_mib >= 90  # the 96 MiB freed are kept for the next request
    first, again, kept_mib = _probe(KVRAG_KEEP_FREED_MEMORY="0")
    assert (first, again) == ("False", "False")
    assert kept_mib < 16  # glibc's defaults: mmapped, returned to the OS on free
