"""Fewer intra-op threads for one thread's CPU forwards, leaving the others alone.

Background chunk encoding runs with fewer threads than requests (a core stays
free for what the caller does before its request: retrieval, embedding,
tokenization). ``torch.set_num_threads`` will not do: in OpenMP builds it sets
the calling thread's OpenMP thread count *and* the process default that every
thread started later (each request's worker thread) inherits, so a request
arriving while the background holds the lower count would run with it
(checked on torch 2.13's OpenMP build: a thread started after another one's
``set_num_threads(1)`` reports 1). OpenMP's own ``omp_set_num_threads`` (and
MKL's thread-local setting) change only the calling thread's count, which
ATen's parallel loops, MKL and oneDNN read; torch's process default is
untouched. Builds without OpenMP (or without those symbols) keep their count:
``per_thread_threads()`` says whether this works here.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _setters() -> tuple[Callable[[int], object], ...]:
    """The C functions that set the calling thread's count (empty: not available)."""
    if not torch.backends.openmp.is_available():
        return ()
    folder = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll"):
        if (folder / name).exists():
            break
    else:
        return ()
    try:
        lib = ctypes.CDLL(str(folder / name))
        omp = lib.omp_set_num_threads  # resolved through torch's own OpenMP runtime
    except (OSError, AttributeError):
        return ()
    omp.argtypes, omp.restype = [ctypes.c_int], None
    setters: list[Callable[[int], object]] = [omp]
    # MKL keeps a thread-local count of its own (torch sets it too); the C
    # spelling takes an int (the lower-case one is the Fortran binding, by pointer).
    mkl = getattr(lib, "MKL_Set_Num_Threads_Local", None)
    if mkl is not None:
        mkl.argtypes, mkl.restype = [ctypes.c_int], ctypes.c_int
        setters.append(mkl)
    return tuple(setters)


def per_thread_threads() -> bool:
    """Whether ``set_thread_threads`` can change one thread's count in this build."""
    return bool(_setters())


def set_thread_threads(n: int) -> bool:
    """Set the calling thread's intra-op thread count to ``n`` (others unchanged).

    Returns False (and changes nothing) where the build has no per-thread setting.
    """
    setters = _setters()
    if not setters:
        return False
    torch.get_num_threads()  # ATen initializes this thread's count first (from the default)
    for setter in setters:
        setter(max(1, int(n)))
    return True
