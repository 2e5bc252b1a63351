"""``bench match`` runs without a model and finds every embedded entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrag_integrations.bench import match
from kvrag_integrations.bench.__main__ import ALL, main


def test_the_match_suite_writes_its_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(match, "QUICK", {"n_chunks": 300, "repeats": 5})
    main(["match", "--quick", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "match.json").read_text())
    assert payload["entries"] == payload["replayed_entries"] == 300
    assert payload["runs_found"] == payload["runs_expected"] == 20
    assert 0 < payload["cover_ms_median"] <= payload["cover_ms_p95"]
    assert payload["command"].endswith(f"bench match --quick --out {tmp_path}")
    assert "| entries |" in (tmp_path / "match.md").read_text()
    assert "match" not in ALL  # ``all`` loads a model; this suite needs none
