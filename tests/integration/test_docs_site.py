"""The documentation site builds with warnings as errors (``mkdocs build --strict``).

Strict mode fails on a broken link or anchor, a nav entry without a page, and
every docstring griffe cannot parse (Google style) in the API reference pages;
a second test parses every docstring of the package, shown on the site or not.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import griffe
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-6000:]}"
    for page in ["index.html", "concepts/index.html", "api/engine/index.html"]:
        assert (site / page).is_file(), f"{page} was not built"
    engine_api = (site / "api/engine/index.html").read_text()
    assert "encode_chunks" in engine_api, "the API reference lacks KVRAGEngine.encode_chunks"


def test_every_docstring_parses_as_google_style(caplog: pytest.LogCaptureFixture) -> None:
    package = griffe.load("kvrag_integrations", search_paths=[str(ROOT)], docstring_parser="google")
    parsed = 0

    def walk(obj: griffe.Object) -> None:
        nonlocal parsed
        if obj.docstring is not None:
            assert obj.docstring.parsed is not None
            parsed += 1
        for member in obj.members.values():
            if not member.is_alias:
                walk(member)

    with caplog.at_level("WARNING", logger="griffe"):
        walk(package)
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("griffe")]
    assert parsed > 200, f"only {parsed} docstrings found: is the package path right?"
    assert not warnings, "griffe warnings:\n" + "\n".join(warnings)
