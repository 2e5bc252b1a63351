"""Shared fixtures: the real default model, loaded once per test run."""

from __future__ import annotations

import pytest

from kvrag_integrations import KVRAGEngine


@pytest.fixture(scope="session")
def engine() -> KVRAGEngine:
    """The bundled SmolLM2-135M-Instruct on CPU (the process-wide shared engine)."""
    return KVRAGEngine.shared()
