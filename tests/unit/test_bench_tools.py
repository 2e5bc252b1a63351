"""``bench tools`` runs without a model: every family streams a long call as invoke reads it."""

from __future__ import annotations

import json
from pathlib import Path

from kvrag_integrations.bench.__main__ import ALL, main


def test_the_tools_suite_writes_its_figures(tmp_path: Path) -> None:
    main(["tools", "--quick", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "tools.json").read_text())
    rows = payload["rows"]
    assert {r["argument_kb"] for r in rows} == {1, 10}
    assert len({r["family"] for r in rows}) == 8  # every family, both forms of two
    assert all(r["equals_invoke"] and r["cpu_s"] > 0 for r in rows)
    assert payload["command"].endswith(f"bench tools --quick --out {tmp_path}")
    assert "| family |" in (tmp_path / "tools.md").read_text()
    assert "tools" not in ALL  # ``all`` loads a model; this suite needs none
