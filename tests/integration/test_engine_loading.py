"""The engine around the real default weights: loading them twice, sharing, exiting.

The engine's behaviour on a model (strategies, segments, faults) is tested in
tests/unit on a tiny random model; what needs the real ``from_pretrained`` path
is here.
"""

from __future__ import annotations

import logging

from corpus import REEF, TOWER

from kvrag_integrations import KVRAGEngine, MemoryKVStore


def test_same_weights_loaded_twice_are_named_and_one_engine_is_shared(engine, caplog) -> None:
    from kvrag_integrations.engine import registry

    key = registry.shared_key(None, "cpu", "float32")
    assert key not in registry.shared_engines.engines()
    try:
        with caplog.at_level(logging.WARNING, logger="kvrag_integrations.engine.engine"):
            second = KVRAGEngine.from_pretrained(dtype="float32")
        assert second.loaded.fingerprint == engine.loaded.fingerprint
        assert second.model is not engine.model
        assert "loaded twice" in caplog.text
        assert repr(second) in caplog.text and caplog.text.count("<KVRAGEngine") == 2
        # from_pretrained registered it: the default engine for that model is this one.
        assert KVRAGEngine.shared(dtype="float32") is second
        assert KVRAGEngine.shared() is engine  # the one registered first keeps its place
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvrag_integrations.engine.engine"):
            KVRAGEngine(engine.loaded, store=MemoryKVStore())  # same weights object: fine
        assert "loaded twice" not in caplog.text
    finally:
        registry.shared_engines.reset(key)


def test_exiting_with_background_encoding_in_flight_is_clean(tmp_path) -> None:
    """atexit closes the workers: a daemon thread killed mid-forward aborts the process."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "from kvrag_integrations import KVRAGEngine\n"
        "e = KVRAGEngine.from_pretrained(on_miss='defer')\n"
        f"chunks = [{TOWER!r} * 8, {REEF!r} * 8]\n"
        "r = e.generate(question='Q?', chunks=chunks, max_new_tokens=1)\n"
        "assert r.fallback == 'uncached' and r.deferred_chunks == 2\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
