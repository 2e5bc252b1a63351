"""Integration tier fixtures: the real default model, loaded once per test run."""

from __future__ import annotations

import pytest

from kvrag_integrations import KVRAGEngine


@pytest.fixture(scope="session")
def engine() -> KVRAGEngine:
    """The bundled SmolLM2-135M-Instruct on CPU (the process-wide shared engine).

    Set to encode missed chunks on the request path (``on_miss="encode"``):
    strategy and exactness tests compare strategies on chunks they did not
    encode first. Tests of the default (``"defer"``: plain prefill, background
    encoding) build their own engine on ``engine.loaded``.

    Chunk caches are stored at model precision (``cache_precision="model"``):
    exactness tests compare reuse against full prefill with float32 tolerances.
    """
    shared = KVRAGEngine.shared()
    shared.on_miss = "encode"
    shared.cache_precision = "model"
    return shared
