"""``python -m kvrag_integrations.bench vllm`` runs and writes its figures (smoke size),
on the session's vLLM (``main(argv, vllm_engine=...)``: the suite starts none)."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_helpers import needs_vllm

from kvrag_integrations.bench import report
from kvrag_integrations.bench.__main__ import main
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

needs_vllm()


def test_the_vllm_suite_writes_json_table_and_renders(
    tmp_path: Path, vllm_engine: VLLMEngine
) -> None:
    main(["vllm", "--quick", "--out", str(tmp_path)], vllm_engine=vllm_engine)
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


def test_the_prefix_hit_part_measures_both_sends_of_each_prompt(
    tmp_path: Path, vllm_engine: VLLMEngine
) -> None:
    args = ["--parts", "prefix-hit", "--lengths", "300,700", "--repeats", "1"]
    main(["vllm", *args, "--out", str(tmp_path)], vllm_engine=vllm_engine)
    assert not (tmp_path / "vllm.json").exists()  # some parts: never over the suite's file
    part = json.loads((tmp_path / "vllm-prefix-hit.json").read_text())["prefix_hit"]
    assert [row["length"] for row in part["rows"]] == [300, 700]
    for row in part["rows"]:
        # loaded by the connector: all but the question and template tail; the prefix
        # hit: whole blocks of the same ids
        store_cached, hit_cached = row["cached_tokens"]
        assert row["prompt_tokens"] - 40 <= store_cached < row["prompt_tokens"]
        assert hit_cached == (row["prompt_tokens"] - 1) // part["block_size"] * part["block_size"]
        assert row["store_ms"] > 0 and row["prefix_hit_ms"] > 0 and row["ratio"] > 0
    assert (tmp_path / "vllm-prefix-hit.md").read_text().startswith("| prompt (tokens) |")


def test_the_blend_part_times_exact_prefill_afresh_and_counts_the_recompute(
    tmp_path: Path, vllm_engine: VLLMEngine
) -> None:
    """Each repeat sends the passages in a new order, so vLLM's exact prefill is
    computed, not served from its prefix cache (a repeat of one order loaded nearly
    the whole prompt and made "full" look 20x faster); blend reports its recompute.
    (What is checked is the prompt and the first token: 4 new tokens, not 32.)"""
    args = ["--parts", "blend", "--items", "1", "--chunks", "3", "--chunk-tokens", "64"]
    args += ["--repeats", "2", "--max-new-tokens", "4"]
    main(["vllm", *args, "--out", str(tmp_path)], vllm_engine=vllm_engine)
    payload = json.loads((tmp_path / "vllm-blend.json").read_text())
    rows, tokens = payload["blend"], payload["blend_median_prompt_tokens"]
    assert rows["vllm_full"]["loaded"] < 0.5 * tokens  # (the template's head at most)
    assert rows["vllm_turbo"]["loaded"] > 0.6 * tokens
    assert rows["vllm_blend"]["recomputed"] > 0
    assert rows["vllm_blend"]["recomputed"] < rows["vllm_blend"]["loaded"]
    assert rows["vllm_full"]["kl"] == 0 and rows["inproc_full"]["kl"] == 0
    assert (tmp_path / "vllm-blend.md").read_text().startswith("| engine, strategy |")
