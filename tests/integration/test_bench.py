"""The benchmark harness end to end at smoke size (``--quick``), then the report.

No timing is asserted: the machine is shared. What is checked: every suite runs,
writes strict JSON with the machine facts, a Markdown table and its PNG plots,
and the numbers that must hold whatever the speed (full is its own reference,
reuse scores match, float16 halves the bytes, ...). One more test checks the
gold log-likelihood against a plain forward.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib", reason="pip install -e '.[test]'")
pytest.importorskip("llama_index.llms.huggingface", reason="pip install -e '.[test]'")

from kvrag_integrations.bench import quality, report
from kvrag_integrations.bench.__main__ import ALL, main
from kvrag_integrations.bench.metrics import answer_loglik, paired_bootstrap
from kvrag_integrations.engine.prompting.tokenize import tokenize_text

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EXPECTED_PNGS = ["ttft", "scaling-chunks", "scaling-length", "quality-tradeoff", "peer"]


def _strict(text: str) -> dict:
    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")

    return json.loads(text, parse_constant=no_constants)


@pytest.fixture(scope="module")
def results(engine, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    main(["all", "--quick", "--out", str(out)])  # engine: the same shared instance
    return out


def test_every_suite_writes_json_table_and_machine(results: Path) -> None:
    for name in ALL:
        payload = _strict((results / f"{name}.json").read_text())
        machine = payload["machine"]
        assert machine["model"] == "SmolLM2-135M-Instruct"
        assert machine["dtype"] == "float32" and machine["device"] == "cpu"
        assert machine["torch"] and machine["transformers"] and machine["cpu_threads"] >= 1
        assert payload["command"].startswith("python -m kvrag_integrations.bench all --quick")
        assert (results / f"{name}.md").read_text().startswith("|") or name in {
            "scaling",
            "memory",
            "rerank",
        }
        assert "|---" in (results / f"{name}.md").read_text()


def test_plots_are_png_files(results: Path) -> None:
    for name in EXPECTED_PNGS:
        data = (results / f"{name}.png").read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name


def test_quality_numbers(results: Path) -> None:
    rows = {r["strategy"]: r for r in _strict((results / "quality.json").read_text())["results"]}
    assert set(rows) == {"full", "turbo", "blend@0.15"}
    assert rows["full"]["kl_vs_full"] == 0 and rows["full"]["top1_vs_full"] == 1
    assert [rows[n]["recompute_ratio"] for n in ("turbo", "blend@0.15", "full")] == [0, 0.15, 1]
    for row in rows.values():
        assert row["gold_loglik"] < 0
    assert rows["turbo"]["recomputed_tokens"] == 0 < rows["blend@0.15"]["recomputed_tokens"]


def test_attention_shares_per_layer(results: Path) -> None:
    """Chunks encoded alone pull the question's deep-layer attention onto their first
    tokens (spurious sinks); behind BOS they do not."""
    payload = _strict((results / "attention.json").read_text())
    alone, sink = payload["contexts"]["alone"], payload["contexts"]["sink"]
    layers = len(alone["chunk_start_share"])
    assert layers == 30 and payload["summed_layers"] == "7-29"
    for context in (alone, sink):
        assert all(
            0 <= x <= 1 for x in context["chunk_start_share"] + context["overlap_with_summed"]
        )
    deep = slice(layers // 2, layers)
    assert min(alone["chunk_start_share"][deep]) > 2 * max(sink["chunk_start_share"][deep])


def test_scaling_points_and_floor(results: Path) -> None:
    payload = _strict((results / "scaling.json").read_text())
    assert [p["n_chunks"] for p in payload["chunks"]] == [1, 2]
    assert [p["chunk_tokens"] for p in payload["length"]] == [16, 32]
    tokens = [p["prompt_tokens"] for p in payload["chunks"]]
    assert tokens[1] > tokens[0]
    for point in payload["chunks"] + payload["length"]:
        assert point["floor_ms"] > 0 and 0 < point["question_tokens"] < point["prompt_tokens"]
        assert set(point["ttft_ms"]) == {"full", "turbo"}


def test_peer_reuses_the_chunks_it_is_given(results: Path) -> None:
    rows = {r["llm"]: r for r in _strict((results / "peer.json").read_text())["results"]}
    assert list(rows) == [
        "HuggingFaceLLM",
        "KVRAGLLM full",
        "KVRAGLLM turbo",
        "KVRAGLLM blend@0.15",
    ]
    assert rows["HuggingFaceLLM"]["speedup"] == 1.0
    assert rows["KVRAGLLM full"]["reused_chunk_tokens"] == 0
    assert rows["KVRAGLLM turbo"]["reused_share_of_chunks"] == 1.0
    # Same model, same prompt text, both greedy: the prompts differ by at most a
    # few tokens at chunk boundaries (segments are tokenized alone).
    assert abs(rows["KVRAGLLM full"]["prompt_tokens"] - rows["HuggingFaceLLM"]["prompt_tokens"]) < 8


def test_cold_rows_and_no_chunk_encoded_twice(results: Path) -> None:
    payload = _strict((results / "cold.json").read_text())
    rows = {r["llm"]: r for r in payload["results"]}
    assert rows["KVRAGLLM full"]["vs_full"] == 1.0
    second = rows["KVRAGLLM turbo second request, right after (no wait)"]
    assert second["fell_back"] == 0 and second["reused"] > 0  # took the queued work over
    assert rows["KVRAGLLM turbo next request, once encoded"]["fell_back"] == 0
    assert payload["max_encodings_per_key"] == 1
    assert payload["cold_vs_full"] > 0 and payload["leftover_slowdown"] > 0


def test_memory_sizes(results: Path, engine) -> None:
    payload = _strict((results / "memory.json").read_text())
    by = {r["dtype"]: r for r in payload["results"]}
    config = engine.model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    assert by["float32"]["kv_bytes_per_token"] == per_token * 4
    assert by["float16"]["kv_bytes_per_token"] == per_token * 2
    assert by["float32"]["turbo_kl_vs_model_dtype"] == 0
    assert all(0 <= r["overhead"] < 0.05 for r in by.values())
    stores = {r["store"] for r in payload["reads"]}
    assert {"memory", "disk"} <= stores
    assert all(r["chunks_per_s"] > 0 for r in payload["reads"])


def test_rerank_reuse_matches(results: Path) -> None:
    payload = _strict((results / "rerank.json").read_text())
    assert payload["max_abs_score_gap"] < 1e-3


def test_report_renders_every_suite(results: Path, tmp_path: Path) -> None:
    for png in results.glob("*.png"):
        shutil.copy(png, tmp_path / png.name)
    for name in ALL:
        shutil.copy(results / f"{name}.json", tmp_path / f"{name}.json")
    docs, readme = tmp_path / "docs" / "benchmarks.md", tmp_path / "README.md"
    docs.parent.mkdir()
    readme.write_text(f"# x\n\n{report.START}\nSTALE-TEXT\n{report.END}\n\ntail\n")
    report.main(["--results", str(tmp_path), "--docs", str(docs), "--readme", str(readme)])
    text = docs.read_text()
    # Sections of non-default presets (quality-ablation, ...) have no quick run.
    for title in (t for name, _, t in report.SECTIONS if name in ALL):
        assert f"## {title}" in text
    assert "![scaling](../scaling-chunks.png)" in text
    assert "Command: `python -m kvrag_integrations.bench all --quick" in text
    block = readme.read_text()
    assert "STALE-TEXT" not in block and block.endswith("tail\n") and "![ttft](ttft.png)" in block


def test_gold_loglik_matches_a_plain_forward(engine) -> None:
    """Teacher forcing after full's cache equals log-probs from one forward over all."""
    chunks = ["The Eiffel Tower is in Paris."]
    pre = engine.prefill(question="Where is the Eiffel Tower?", chunks=chunks, strategy="full")
    answer = tokenize_text(engine.tokenizer, "In Paris, France")
    got = answer_loglik(engine.model, pre.output.kv, pre.logits, answer)
    ids = torch.cat([pre.prompt.input_ids, answer]).unsqueeze(0)
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    n = pre.prompt.num_tokens
    logp = torch.log_softmax(logits[n - 1 : -1], dim=-1)
    expected = logp.gather(1, answer.unsqueeze(1)).mean().item()
    assert got == pytest.approx(expected, abs=1e-4)
    assert pre.output.kv.num_tokens == n  # the prompt cache was left as it was


def test_paired_table_compares_each_blend_row_with_turbo_on_the_same_questions() -> None:
    def row(name: str, kl: list[float], f1: list[float]) -> dict:
        return {"strategy": name, "kl_per_item": kl, "f1_vs_full_per_item": f1}

    payload = {
        "results": [
            row("full", [0.0] * 4, [1.0] * 4),
            row("turbo", [0.4, 0.2, 0.6, 0.2], [0.5, 1.0, 0.0, 1.0]),
            row("blend@0.15", [0.2, 0.1, 0.3, 0.3], [1.0, 1.0, 0.5, 0.5]),
        ]
    }
    lines = quality.paired_table(payload).splitlines()
    assert len(lines) == 3 and lines[2].startswith("| blend@0.15 | 0.64 (")
    assert "| 3/4 | 0.75 (" in lines[2] and "| +0.12 (" in lines[2]
    payload["results"].append(row("blend(recompute_ratio=0.15, x=1)", [0.1] * 4, [1.0] * 4))
    both = quality.table({**payload, "results": [
        {**r, "ttft_ms": 1.0, "speedup": 1.0, "kl_vs_full": 0.1, "top1_vs_full": 1.0,
         "f1_vs_full": 1.0, "f1_gold": 0.0} for r in payload["results"]]})  # fmt: skip
    assert "| against blend@0.15, same questions |" in both
    assert "| blend(recompute_ratio=0.15, x=1) | 0.44 (" in both.split("against blend@0.15")[1]
    # Older payloads without per-question lists render the plain table only.
    assert quality.paired_table({"results": [{"strategy": "turbo"}]}) == ""
    with pytest.raises(ValueError, match="same non-empty"):
        paired_bootstrap([0.1], [0.1, 0.2])
    estimate, low, high = paired_bootstrap([0.2, 0.1, 0.3, 0.3], [0.4, 0.2, 0.6, 0.2])
    assert low <= estimate <= high and low < high


def test_agreement_preset_ends_at_full_prefill_by_the_layered_path(engine, tmp_path: Path) -> None:
    """Ratio 1.0 is full prefill through the blend path: same first token, same answer."""
    main(["quality", "--preset", "agreement", "--quick", "--no-loglik", "--items", "1",
          "--out", str(tmp_path)])  # fmt: skip
    payload = _strict((tmp_path / "quality-agreement.json").read_text())
    rows = {r["strategy"]: r for r in payload["results"]}
    assert list(rows) == ["full", "turbo", "blend@0.15", "blend@0.5", "blend@0.8", "blend@1"]
    assert rows["blend@1"]["kl_vs_full"] < 1e-6 and rows["blend@1"]["f1_vs_full"] == 1
    assert rows["turbo"]["kl_vs_full"] > 1e-3  # the ends of the axis differ measurably
    assert all(r["gold_loglik"] is None for r in rows.values())  # --no-loglik


def test_ttft_context_preset_runs_engine_settings_on_their_own_engine(engine, tmp_path) -> None:
    """A row with ``chunk_context`` reads entries encoded behind BOS, not the base
    engine's: its prefill reuses chunk tokens (TTFT of a hit, not of a miss)."""
    main(["ttft", "--preset", "context", "--quick", "--out", str(tmp_path)])
    payload = _strict((tmp_path / "ttft-context.json").read_text())
    names = [r["strategy"] for r in payload["results"]]
    assert names == ["full", "turbo", "blend@0.15",
                     "blend(recompute_ratio=0.15, selection=query, chunk_context=sink)",
                     "turbo(chunk_context=sink)"]  # fmt: skip
    assert all(r["ttft_ms"] > 0 for r in payload["results"])


def test_gpu_preset_with_dummy_weights_from_the_command_line(tmp_path: Path) -> None:
    """``--model <shape> --dummy-weights`` builds the shape with the bundled
    tokenizer; the gpu preset writes gpu-scaling-<shape> (on CPU: where --out says,
    never docs/bench)."""
    main(
        ["scaling", "--preset", "gpu", "--quick", "--model", "tiny-llama", "--dummy-weights",
         "--device", "cpu", "--no-plots", "--out", str(tmp_path)]
    )  # fmt: skip
    payload = _strict((tmp_path / "gpu-scaling-tiny-llama.json").read_text())
    assert payload["machine"]["model"] == "tiny-llama (dummy weights)"
    assert payload["strategies"] == ["full", "turbo", "turbo(store=tiered)", "blend@0.15"]
    assert [p["n_chunks"] for p in payload["chunks"]] == [2, 4]
    assert "--dummy-weights" in payload["command"]


def test_the_cluster_suite_measures_one_server_and_clusters_of_1_and_3_primaries(
    engine, tmp_path: Path
) -> None:
    """Run by name (not in ``all``): it starts its own Redis servers and clusters."""
    pytest.importorskip("redis", reason="pip install -e '.[test]'")
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli not found (apt-get install redis-server)")
    main(["cluster", "--quick", "--no-plots", "--out", str(tmp_path)])
    payload = _strict((tmp_path / "cluster.json").read_text())
    rows = {row["topology"]: row for row in payload["results"]}
    assert set(rows) == {"one server", "1P+0R", "3P+3R"}
    for row in rows.values():
        assert row["load_mib_s"] > 0 and row["turbo_ttft_ms"] > 0
        assert row["oom_errors"] == 0 and row["most_used_share"] <= 1  # the budget held
