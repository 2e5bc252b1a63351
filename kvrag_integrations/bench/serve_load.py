"""Load on the server against vLLM alone, by vLLM's own serving benchmark.

``python -m kvrag_integrations.bench serve`` starts our server (``python -m
kvrag_integrations.vllm.serve`` on a fresh disk store, at the README's defaults)
and then vLLM's own OpenAI server on the same model and flags (prefix caching
on, no connector), one at a time, and measures each with
``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs; its arguments are kept
with the results, ``vllm_bench_args``): RAG requests (``bench.load_data``:
questions over ``n_chunks`` stored passages in a new order each time, a share of
them later turns of a chat) at each of ``concurrencies`` (``--max-concurrency``,
requests sent at once, no rate limit), anonymous clients as a new user's app is
(no key, no salt), ``max_new_tokens`` each (``--ignore-eos``: the same output on
both). Before the load, each question's passages are stored through our server
(``VLLMEngine.connect(url).encode_chunks``); vLLM alone has no store.

Measured per server and concurrency: requests/s, output tokens/s, TTFT p50 and
p99 (vLLM's figures); the share of the prompt each server reports cached
(``usage.prompt_tokens_details``, median of a few requests of new orders); and,
under abuse, the same load at ``flood_at`` beside one anonymous client flooding
(``bench.flood``: glue, private prefixes and saves, beam search, a new salt each
time, ``flood_concurrency`` requests in flight, from another address than the
load's): the load's TTFT p99 against its value without the flood.

Examples:
    python -m kvrag_integrations.bench serve --out docs/bench
    python -m kvrag_integrations.bench serve --tag run2 --out docs/bench
    python -m kvrag_integrations.bench serve --quick
"""

from __future__ import annotations

import os
import shlex
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from kvrag_integrations.bench import load_data, plots
from kvrag_integrations.bench.common import RagItem, markdown_table
from kvrag_integrations.bench.flood import KINDS, LOOPBACK_FLOODER, Flood
from kvrag_integrations.bench.openai_apps import Server

QUICK = {
    "items": 2,
    "n_chunks": 2,
    "chunk_tokens": 64,
    "max_new_tokens": 4,
    "concurrencies": [2],
    "requests": 4,
    "flood_concurrency": len(KINDS),  # one request of each kind at once
}
SERVERS = {"kvrag": "ours (vLLM + KVRAGConnector)", "plain": "vLLM alone (prefix caching)"}
# What ours must reach against vLLM alone (issue 59): requests/s, and TTFT p50 and
# p99 (vLLM's over ours), by concurrency; and the flood's bound on the load's TTFT p99.
TARGETS = {1: 2.0, "more": 5.0}
FLOOD_BOUND = 1.5
MIN_REQUESTS = 24
MAX_MODEL_LEN = 8192


def run(
    engine: Any,
    items: list[RagItem],
    *,
    n_chunks: int = 6,
    chunk_tokens: int | None = None,
    max_new_tokens: int = 32,
    concurrencies: list[int] | None = None,
    requests: int | None = None,
    chat_share: float = 0.25,
    flood_concurrency: int = 4,
    flood_at: int | None = None,
    flood_kinds: list[str] | None = None,
    api_server_count: int = 1,
    servers: list[str] | None = None,
    urls: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The figures above. ``requests``: requests at each concurrency (default
    ``max(MIN_REQUESTS, 4 x concurrency)``); ``flood_at``: the concurrency of
    the abuse run (default: 4 where measured, else the highest); ``flood_kinds``:
    what the flooder sends (default: every kind of ``flood.KINDS``, in turn; one
    kind alone says what it costs the load); ``servers``: the kinds to start and
    measure (``"kvrag"``, ``"plain"``; default both); ``urls``: servers already
    running, by kind (only those are measured)."""
    kinds = tuple(flood_kinds or KINDS)
    unknown = sorted({*kinds} - {*KINDS}) + sorted({*(servers or ())} - {*SERVERS})
    if unknown:
        raise ValueError(f"unknown {unknown}: flood kinds {KINDS}, servers {tuple(SERVERS)}")
    from transformers import AutoTokenizer

    from kvrag_integrations.bench.vllm_serving import vllm_version
    from kvrag_integrations.vllm.launch import served_checkpoint

    load_before = os.getloadavg()[0]
    levels = list(concurrencies or [1, 4, 16])
    flood_at = flood_at or (4 if 4 in levels else max(levels))
    folder, name = served_checkpoint(None)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sets = load_data.passage_sets(items, tokenizer, n_chunks, chunk_tokens)
    counts = {c: requests or max(MIN_REQUESTS, 4 * c) for c in levels}
    workdir = Path(tempfile.mkdtemp(prefix="kvrag-bench-serve-"))

    def dataset(seed: int, count: int, concurrency: int) -> Path:
        loads = load_data.rag_requests(
            items, sets, count, chat_share=chat_share, concurrency=concurrency, seed=seed
        )
        path = workdir / f"load-{seed}.jsonl"
        return load_data.write_dataset(path, tokenizer, loads, max_new_tokens)

    files = {c: dataset(c, counts[c], c) for c in levels}
    longest = max(_longest_prompt(path, tokenizer) for path in files.values())
    kv_bytes = _kv_cache_bytes(folder, max(levels) * (longest + max_new_tokens))
    flags = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(kv_bytes)]
    measured: dict[str, Any] = {}
    for kind in list(urls or servers or SERVERS):
        extra = [*flags, "--api-server-count", str(api_server_count)] if kind == "kvrag" else flags
        with ExitStack() as stack:
            url = (urls or {}).get(kind) or stack.enter_context(Server(kind, extra)).url
            _warm_up(url, name)
            if kind == "kvrag":
                _store(url, sets)
            runs = {}
            for c in levels:
                runs[c] = _bench(url, name, folder, files[c], counts[c], c, max_new_tokens)
            probes = dataset(1000, 6, 1)
            measured[kind] = {"runs": runs, "cached_share": _cached_share(url, name, probes)}
            if flood_concurrency > 0:
                path = dataset(2000, counts[flood_at], flood_at)
                source = LOOPBACK_FLOODER if _loopback(url) else None
                flood = Flood(url, name, sets, tokenizer, flood_concurrency, kinds, source)
                flood.start()
                try:
                    flooded = _bench(url, name, folder, path, counts[flood_at], flood_at,
                                     max_new_tokens)  # fmt: skip
                finally:
                    flooder = flood.stop()
                measured[kind]["flood"] = {"run": flooded, "flooder": flooder}
    return {
        "vllm": vllm_version(),
        "served_model": name,
        "items": len(items),
        "n_chunks": n_chunks,
        "chunk_tokens": chunk_tokens or "whole",
        "max_new_tokens": max_new_tokens,
        "chat_share": chat_share,
        "requests": counts,
        "longest_prompt_tokens": longest,
        "kv_cache_memory_bytes": kv_bytes,
        "api_server_count": api_server_count,
        "flood_at": flood_at,
        "flood_concurrency": flood_concurrency,
        "flood_kinds": list(kinds),
        # how busy the host was (others' work counts: a figure is quiet only near 0)
        "host_load": f"{load_before:.1f} -> {os.getloadavg()[0]:.1f} (1-min load average, "
        f"{os.cpu_count()} cores)",
        "servers": measured,
        "summary": summarize(measured, levels, flood_at),
    }


def _warm_up(url: str, name: str) -> None:
    """A few short requests first: a server's first requests are slow on any server."""
    with httpx.Client(base_url=f"{url}/v1", timeout=600) as http:
        for _ in range(3):
            body = {"model": name, "prompt": "Say hello.", "max_tokens": 2}
            http.post("/completions", json=body).raise_for_status()


def _store(url: str, sets: list[list[str]]) -> None:
    """Each question's passages stored through the server (an application's ingestion)."""
    from kvrag_integrations.vllm import VLLMEngine

    with VLLMEngine.connect(url) as client:
        client.encode_chunks([p for passages in sets for p in passages], show_progress=False)


def _longest_prompt(path: Path, tokenizer: Any) -> int:
    import json

    lines = path.read_text(encoding="utf-8").splitlines()
    return max(len(tokenizer(json.loads(line)["prompt"])["input_ids"]) for line in lines)


def _kv_cache_bytes(folder: str, tokens: int) -> int:
    """vLLM's KV cache (float32) for ``tokens`` tokens at once, within the bounds of a
    CPU server's own (``launch.CPU_KV_BOUNDS``): the same on both servers."""
    from transformers import AutoConfig

    from kvrag_integrations.vllm.launch import CPU_KV_BOUNDS

    config = AutoConfig.from_pretrained(folder)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * 4
    low, high = CPU_KV_BOUNDS
    return max(low, min(high, int(1.1 * tokens * per_token)))


def vllm_bench_args(
    url: str, name: str, tokenizer: str, dataset: Path, count: int, concurrency: int, output: int
) -> list[str]:
    """``vllm bench serve``'s arguments for one run (as ``vllm.benchmarks.serve`` reads them)."""
    return [
        *("--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions"),
        *("--model", name, "--served-model-name", name, "--tokenizer", tokenizer),
        *("--dataset-name", "custom", "--dataset-path", str(dataset)),
        *("--skip-chat-template", "--disable-shuffle", "--num-prompts", str(count)),
        *("--custom-output-len", str(output), "--ignore-eos", "--temperature", "0"),
        *("--max-concurrency", str(concurrency), "--request-rate", "inf"),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"),
        *("--num-warmups", "0", "--ready-check-timeout-sec", "0", "--disable-tqdm"),
    ]


def _bench(
    url: str, name: str, tokenizer: str, dataset: Path, count: int, concurrency: int, output: int
) -> dict[str, Any]:
    """One run of vLLM's serving benchmark: its figures (no per-request lists)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = vllm_bench_args(url, name, tokenizer, dataset, count, concurrency, output)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = main(parser.parse_args(argv))
    # (as plain numbers: vLLM's percentiles are numpy's)
    out: dict[str, Any] = {k: int(result[k]) for k in ("completed", "failed") if k in result}
    totals = ("duration", "total_input_tokens", "total_output_tokens")
    figures = (k for k in result if k in totals or k.endswith(("_throughput", "_ms")))
    out.update({k: float(result[k]) for k in figures})
    out["vllm_bench_args"] = shlex.join(argv)
    _check_up(url)
    return out


def _check_up(url: str) -> None:
    """A server that stopped answering during a run (killed for memory, crashed)
    makes its figures meaningless: the suite stops, saying so."""
    try:
        healthy = httpx.get(f"{url}/health", timeout=60).status_code == 200
    except httpx.HTTPError:
        healthy = False
    if not healthy:
        raise RuntimeError(f"the server at {url} stopped answering during the load")


def _cached_share(url: str, name: str, dataset: Path) -> float:
    """The median share of the prompt the server reports cached, over requests of
    the load's kind in orders not sent before."""
    import json

    shares = []
    with httpx.Client(base_url=f"{url}/v1", timeout=600) as http:
        for line in dataset.read_text(encoding="utf-8").splitlines():
            body = {"model": name, "prompt": json.loads(line)["prompt"], "max_tokens": 1}
            usage = http.post("/completions", json=body).raise_for_status().json()["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            shares.append(cached / usage["prompt_tokens"])
    return statistics.median(shares)


def summarize(measured: dict[str, Any], levels: list[int], flood_at: int) -> dict[str, Any]:
    """Ours against vLLM alone per concurrency (where both were measured), against
    ``TARGETS``; the flood's effect on each server's load."""
    out: dict[str, Any] = {"by_concurrency": {}, "flood": {}}
    ours, plain = measured.get("kvrag"), measured.get("plain")
    for c in levels if ours and plain else []:
        mine, theirs = ours["runs"][c], plain["runs"][c]
        target = TARGETS[1] if c == 1 else TARGETS["more"]
        ratios = {
            "requests_per_s": mine["request_throughput"] / theirs["request_throughput"],
            "ttft_p50": theirs["median_ttft_ms"] / mine["median_ttft_ms"],
            "ttft_p99": theirs["p99_ttft_ms"] / mine["p99_ttft_ms"],
        }
        out["by_concurrency"][c] = {
            "ratios": ratios,
            "target": target,
            "met": bool(all(r >= target for r in ratios.values())),
        }
    for kind, figures in measured.items():
        if "flood" in figures:
            base = figures["runs"][flood_at]["p99_ttft_ms"]
            ratio = figures["flood"]["run"]["p99_ttft_ms"] / base
            out["flood"][kind] = {"p99_ratio": ratio, "within": bool(ratio <= FLOOD_BOUND)}
    return out


def table(payload: dict[str, Any]) -> str:
    """Per server and concurrency: vLLM's figures; then ours over vLLM alone, and the flood."""
    rows = []
    for kind, figures in payload["servers"].items():
        for c, r in figures["runs"].items():
            rows.append(_row(SERVERS[kind], c, r, figures["cached_share"]))
        if "flood" in figures:
            run = figures["flood"]["run"]
            label = f"{SERVERS[kind]}, beside the flood"
            rows.append(_row(label, payload["flood_at"], run, figures["cached_share"]))
    head = ["server", "concurrency", "requests/s", "output tokens/s", "TTFT p50 ms"]
    text = markdown_table([*head, "TTFT p99 ms", "prompt cached %", "failed"], rows)
    summary = payload["summary"]
    if summary["by_concurrency"]:
        ratio_rows = [
            [c, *(f"{v:.1f}x" for v in s["ratios"].values()), f"{s['target']:.0f}x", _yes(s["met"])]
            for c, s in summary["by_concurrency"].items()
        ]
        heads = ["concurrency", "requests/s", "TTFT p50", "TTFT p99", "target", "met"]
        text += "\n\nOurs over vLLM alone:\n\n" + markdown_table(heads, ratio_rows)
    for kind, flood in summary["flood"].items():
        flooder = payload["servers"][kind]["flood"]["flooder"]
        text += (
            f"\n\n{SERVERS[kind]}: the load's TTFT p99 beside the flood is "
            f"{flood['p99_ratio']:.2f}x its value without (bound {FLOOD_BOUND}x: "
            f"{'within' if flood['within'] else 'over'}); the flooder "
            f"({', '.join(payload.get('flood_kinds', KINDS))}) sent "
            + ", ".join(f"{n} {k}" for k, n in flooder["counts"].items())
            + "."
        )
    return text


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _row(label: str, c: Any, r: dict[str, Any], share: float) -> list[Any]:
    return [
        label,
        c,
        f"{r['request_throughput']:.2f}",
        f"{r['output_throughput']:.1f}",
        f"{r['median_ttft_ms']:.0f}",
        f"{r['p99_ttft_ms']:.0f}",
        f"{100 * share:.0f}",
        r.get("failed", 0),
    ]


def plot(payload: dict[str, Any], folder: Path, name: str) -> list[Path]:
    return [plots.load_lines(payload, folder / f"{name}.png", SERVERS)]


def _loopback(url: str) -> bool:
    """Whether ``url``'s server is on this host's loopback (the flooder can then send
    from another loopback address, as another host)."""
    host = httpx.URL(url).host
    return host in ("localhost", "127.0.0.1")
