"""``python -m kvrag_integrations.bench vllm`` runs and writes its figures (smoke size)."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_helpers import needs_vllm

from kvrag_integrations.bench import report
from kvrag_integrations.bench.__main__ import main

needs_vllm()


def test_the_vllm_suite_writes_json_table_and_renders(tmp_path: Path) -> None:
    main(["vllm", "--quick", "--out", str(tmp_path)])
    payload = json.loads((tmp_path / "vllm.json").read_text())
    assert payload["command"] == f"python -m kvrag_integrations.bench vllm --quick --out {tmp_path}"
    assert payload["vllm"].startswith("vllm")
    # reordered chunks, every one stored: only the question and the template's tail are
    # computed (a connector that loads nothing gives about 0, vLLM's own prefix cache too)
    assert 0.6 <= payload["cached_share_median"] <= 1
    assert payload["vllm_full_cached_share_median"] < 0.5  # exact: the new order is computed
    assert payload["ttft_ms"]["vllm_turbo"] > 0 and payload["vllm_concurrent_tokens"] > 0
    assert payload["agree_of"] == payload["items"] == 2
    assert payload["agree_answers"] >= 1 and payload["max_logprob_gap"] < 0.1  # float16 entries
    assert payload["lcel_second_cached_share"] >= 0.5
    assert (tmp_path / "vllm.md").read_text().startswith("| engine |")
    docs, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    readme.write_text(f"{report.START}\n{report.END}\n")
    report.main(["--results", str(tmp_path), "--docs", str(docs), "--readme", str(readme)])
    assert "## vLLM with the KV connector" in docs.read_text()
