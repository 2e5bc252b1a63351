"""The GPU benchmark's parts that run anywhere: named shapes with random weights,
the scaling suite's gpu preset at smoke size, where its files go, its report.

No timing is asserted (a CPU smoke run is not a GPU figure); what is checked is
that the shapes are the published ones, that reuse on a dummy shape is as exact
as on any model, and that the preset measures every row it promises.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag_integrations import Chunk, KVRAGEngine, Text
from kvrag_integrations.bench import decode, report, scaling, shapes
from kvrag_integrations.bench.__main__ import (
    out_dir,
    parser,
    preset_options,
    result_name,
    suite_options,
)
from kvrag_integrations.bench.common import load_items, write_results
from kvrag_integrations.engine.modeling.model import LoadedModel


@pytest.mark.parametrize(
    ("name", "layers", "kv_bytes_per_token", "params_b"),
    [
        ("llama-3.2-1b", 16, 32 * 1024, 1.24),
        ("llama-3.1-8b", 32, 128 * 1024, 8.03),
        ("qwen2.5-7b", 28, 56 * 1024, 7.62),
        ("mistral-7b", 32, 128 * 1024, 7.25),
    ],
)
def test_shapes_are_the_published_ones(
    name: str, layers: int, kv_bytes_per_token: int, params_b: float
) -> None:
    """Layers, KV bytes per token at 16 bits and parameter count (built on the meta
    device: nothing is allocated)."""
    import transformers

    config = shapes.shape_config(name)
    with torch.device("meta"):
        lm = transformers.AutoModelForCausalLM.from_config(config)
    head_dim = lm.model.layers[0].self_attn.head_dim
    assert config.num_hidden_layers == layers
    assert 2 * layers * config.num_key_value_heads * head_dim * 2 == kv_bytes_per_token
    # Tied output weights count once (transformers 5.0.0 does not tie them on meta).
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    params = sum(p.numel() for n, p in lm.named_parameters() if n not in tied)
    assert params / 1e9 == pytest.approx(params_b, abs=0.01)


def test_dummy_shape_reuse_is_exact(tiny_loaded: LoadedModel) -> None:
    """A dummy shape is a supported model like any other: turbo with a leading chunk
    equals full prefill."""
    loaded = shapes.dummy_model("tiny-llama", "cpu", tokenizer=tiny_loaded.tokenizer)
    assert loaded.dtype == torch.float32 and loaded.name == "tiny-llama (dummy weights)"
    engine = KVRAGEngine(loaded, cache_precision="model", on_miss="encode")
    segments = [Chunk("The tower is in Paris, on the Champ de Mars."), Text("\nWhere?")]
    turbo = engine.prefill(segments, strategy="turbo", chat_template=False).logits
    full = engine.prefill(segments, strategy="full", chat_template=False).logits
    torch.testing.assert_close(turbo, full, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="unknown model shape"):
        shapes.shape_config("llama-9")


def args_of(*argv: str) -> argparse.Namespace:
    return parser().parse_args(["scaling", *argv])


def test_gpu_preset_sizes_and_file_names(engine: KVRAGEngine) -> None:
    gpu = preset_options(scaling, args_of("--preset", "gpu"))
    assert gpu["counts"] == [16, 64, 128] and gpu["chunk_tokens"] == 256 and gpu["lengths"] == []
    quick = preset_options(scaling, args_of("--preset", "gpu", "--quick"))
    assert quick["lengths"] == [] and max(quick["counts"]) < 16
    named = args_of("--preset", "gpu", "--model", "llama-3.1-8b", "--dummy-weights")
    assert result_name("scaling", named, engine) == "gpu-scaling-llama-3.1-8b"
    # measured on a CPU: never into docs/bench unless asked
    assert out_dir(named, engine) == "bench_results"
    assert out_dir(args_of("--out", "x"), engine) == "x"


def gpu_section(module: Any, suite: str, payload: dict, folder: Path) -> str:
    """The report's section of ``payload`` written as a GPU run's file (the only one found)."""
    payload["machine"] = {"model": "tiny-llama (dummy weights)", "gpu": "NVIDIA H100"}
    payload["command"] = f"python -m kvrag_integrations.bench {suite} --preset gpu"
    name = f"gpu-{suite}-tiny-llama"
    write_results(folder, name, payload, module.table(payload))
    found = report.load(folder)
    assert list(found) == [name]
    return report.section(name, found[name])


def test_gpu_preset_smoke_run_and_report(engine: KVRAGEngine, tmp_path: Path) -> None:
    """Every row the preset promises is measured at every count, from each store, and
    the report renders the file as a GPU section after the scaling one."""
    options = suite_options(scaling, args_of("--preset", "gpu", "--quick"))
    payload = scaling.run(engine, load_items(None, 2), **options)
    rows = ["full", "turbo", "turbo(store=tiered)", "blend@0.15"]
    assert payload["strategies"] == rows and payload["length"] == []
    assert [p["n_chunks"] for p in payload["chunks"]] == options["counts"]
    for point in payload["chunks"]:
        assert set(point["ttft_ms"]) == set(rows) and point["floor_ms"] > 0
    text = gpu_section(scaling, "scaling", payload, tmp_path)
    assert text.startswith("## On a GPU: TTFT from 16 to 128 chunks, tiny-llama (dummy weights)")
    assert "turbo(store=tiered)" in text and "chunk length" not in text
    assert json.loads((tmp_path / "gpu-scaling-tiny-llama.json").read_text())["chunks"]


def test_decode_suite_preset_smoke_run_and_report(tiny_loaded: LoadedModel, tmp_path: Path) -> None:
    """``bench decode``: the gpu preset's sizes (~4k and ~16k tokens, 65 new tokens);
    at smoke size on a dummy shape, every length is measured for the engine and HF's
    generate (which decodes every token asked), and the report renders it."""
    gpu = preset_options(decode, parser().parse_args(["decode", "--preset", "gpu"]))
    assert gpu["lengths"] == [4096, 16384] and gpu["max_new_tokens"] == 65
    quick_args = parser().parse_args(["decode", "--preset", "gpu", "--quick"])
    options = suite_options(decode, quick_args)
    assert max(options["lengths"]) < 256 and options["max_new_tokens"] < 65
    loaded = shapes.dummy_model("tiny-llama", "cpu", tokenizer=tiny_loaded.tokenizer)
    engine = KVRAGEngine(loaded, cache_precision="model", on_miss="encode")
    assert suite_options(decode, parser().parse_args(["decode", "--static-on-cpu"]))[
        "static_on_cpu"
    ]
    payload = decode.run(engine, load_items(None, 2), **options, static_on_cpu=True)
    assert [p["target_tokens"] for p in payload["points"]] == options["lengths"]
    for point in payload["points"]:
        assert point["prompt_tokens"] >= point["target_tokens"]
        assert point["hf"]["generated"] == options["max_new_tokens"]
        assert point["engine"]["generated"] == options["max_new_tokens"]  # min_new_tokens
        assert isinstance(point["engine"]["ms_per_token"], float)  # (a smoke run times nothing)
        # the engine's column decoded statically (an eager step on CPU), the next eagerly
        assert point["engine"]["path"].startswith("static, bucket ")
        assert point["eager"]["path"].startswith("eager: device cpu")
        assert point["eager"]["generated"] == point["engine"]["generated"]
    steps = payload["filled"]  # one step at three filled lengths inside one bucket
    assert steps["filled"] == options["filled"] and steps["bucket"] > max(steps["filled"])
    assert len(steps["engine_ms"]) == len(steps["masked_sdpa_ms"]) == 3
    assert steps["engine_attention"] == "masked SDPA"  # no Triton kernel on CPU
    assert engine.loaded.decoder.devices == ("cuda",)  # the run's opt-in is undone
    named = parser().parse_args(
        ["decode", "--preset", "gpu", "--model", "llama-3.1-8b", "--dummy-weights"]
    )
    assert result_name("decode", named, engine) == "gpu-decode-llama-3.1-8b"
    text = gpu_section(decode, "decode", payload, tmp_path)
    assert text.startswith("## On a GPU: decoding at batch 1 after turbo, tiny-llama")
    assert "HF generate ms/token" in text and "engine eager ms/token" in text
    assert "| filled slots | engine (masked SDPA) | masked SDPA |" in text
