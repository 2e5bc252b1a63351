"""Fixtures and settings both tiers share (tests/unit and tests/integration).

Tier-specific fixtures live in ``tests/unit/conftest.py`` (a tiny random model)
and ``tests/integration/conftest.py`` (the real default model, a Redis server).
"""

from __future__ import annotations

import os

# No model hub and no telemetry: tests must run on a machine without internet.
# One setting for every chromadb client in the run (chromadb refuses two
# in-process clients whose settings differ).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")
