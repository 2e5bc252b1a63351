"""What every benchmark suite shares: data, timing, machine facts, result files."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_DATA = Path("..") / "shared" / "data" / "musique_dev.json"


@dataclass
class RagItem:
    """One benchmark question with its passages (chunks) and gold answers."""

    question: str
    chunks: list[str]
    answers: list[str]


def load_items(path: str | os.PathLike | None, count: int | None = None) -> list[RagItem]:
    """MuSiQue-format items (``question``, ``answers``, ``ctxs[].text``).

    ``path=None`` uses ``../shared/data/musique_dev.json`` when present, else the
    bundled sample corpus (one item per question, every passage as context).
    """
    candidate = Path(path) if path is not None else DEFAULT_DATA
    if candidate.is_file():
        raw = json.loads(candidate.read_text(encoding="utf-8"))
        items = [
            RagItem(r["question"], [c["text"] for c in r["ctxs"]], list(r["answers"])) for r in raw
        ]
    elif path is not None:
        raise FileNotFoundError(f"benchmark data not found: {candidate}")
    else:
        from kvrag_integrations.demo import load_sample_corpus

        corpus = load_sample_corpus()
        passages = [p["text"] for p in corpus["passages"]]
        items = [RagItem(q["question"], passages, [q["answer"]]) for q in corpus["questions"]]
    return items[:count] if count else items


def trim_to_tokens(tokenizer: Any, text: str, n_tokens: int) -> str:
    """``text`` cut to about ``n_tokens`` tokens (at a token boundary)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids).strip()


def trimmed_chunks(tokenizer: Any, item: RagItem, n_chunks: int, n_tokens: int) -> list[str]:
    """The item's first ``n_chunks`` passages cut to about ``n_tokens`` tokens (empty ones
    dropped): the chunks of one benchmark prompt."""
    chunks = [trim_to_tokens(tokenizer, text, n_tokens) for text in item.chunks[:n_chunks]]
    return [c for c in chunks if c.strip()]


def chunk_pool(tokenizer: Any, items: list[RagItem], n_tokens: int) -> list[str]:
    """Distinct passages of at least ``n_tokens`` tokens, each cut to exactly that many."""
    seen, pool = set(), []
    for item in items:
        for text in item.chunks:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) < n_tokens:
                continue
            cut = tokenizer.decode(ids[:n_tokens]).strip()
            if cut and cut not in seen:
                seen.add(cut)
                pool.append(cut)
    return pool


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, Any]:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times, last = [], None
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), last


def machine_info(engine: Any = None) -> dict[str, Any]:
    """Where a figure came from: CPU/GPU, threads, versions, model and dtype."""
    info: dict[str, Any] = {
        "cpu": _cpu_name(),
        "cpu_cores": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "date": time.strftime("%Y-%m-%d"),
    }
    info.update(package_versions())
    if engine is not None:
        info.update(
            model=engine.model_name,
            device=str(engine.device),
            dtype=str(engine.dtype).replace("torch.", ""),
            context_window=engine.context_window,
        )
    return info


_PACKAGES = {
    "torch": "torch",
    "transformers": "transformers",
    "llama_index_core": "llama-index-core",
    "llama_index_llms_huggingface": "llama-index-llms-huggingface",
    "numpy": "numpy",
    "kvrag_integrations": "kvrag-integrations",
}


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages a figure depends on (None: not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for field, dist in _PACKAGES.items():
        try:
            out[field] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[field] = None
    out["torch"] = torch.__version__  # the build tag (+cpu, +cu124) matters
    return out


def resolve_device(device: str | None) -> str:
    """``"auto"``/None: ``"cuda"`` when a GPU is visible, else ``"cpu"``.

    Examples:
        >>> resolve_device("cpu")
        'cpu'
    """
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def sync(engine: Any) -> None:
    """Wait for queued GPU work (a no-op on CPU) so wall times are real."""
    if engine is not None and engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub Markdown table; floats get three significant digits (whole numbers from 100).

    Examples:
        >>> print(markdown_table(["a", "b"], [[7184.2, 0.04567]]))
        | a | b |
        |---|---|
        | 7184 | 0.0457 |
    """

    def cell(v: Any) -> str:
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return "-"
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    out_dir: str | os.PathLike, suite: str, payload: dict[str, Any], table: str
) -> Path:
    """Write ``<suite>.json`` and ``<suite>.md`` under ``out_dir``; return the JSON path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{suite}.json"
    text = json.dumps(_finite(payload), indent=2, default=str, allow_nan=False)
    path.write_text(text + "\n")
    (out / f"{suite}.md").write_text(table + "\n")
    return path


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None (strict JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def append_values(row: dict[str, list[float]], **values: float) -> None:
    """Append each value to its list in ``row`` (one list per measured quantity)."""
    for key, value in values.items():
        row.setdefault(key, []).append(value)


def count_encodings(engine: Any) -> Counter[str]:
    """Keys encoded, counted per key, whoever encodes them: requests, the background
    worker and ingestion all go through ``engine.caches.encode_and_store``."""
    counts: Counter[str] = Counter()
    encode = engine.caches.encode_and_store

    def counted(ids: Any, *args: Any, **kwargs: Any) -> Any:
        done = encode(ids, *args, **kwargs)
        counts.update(list(done))
        return done

    engine.caches.encode_and_store = counted
    return counts


def other_orders(chunks: list[str], count: int) -> list[list[str]]:
    """``count`` orders of ``chunks`` other than the given one (rotations, then
    reversed): a prompt vLLM's prefix cache has not seen in that order."""
    n = len(chunks)
    orders = [chunks[k:] + chunks[:k] for k in range(1, n)] + [chunks[::-1]]
    distinct = [o for i, o in enumerate(orders) if o != chunks and o not in orders[:i]]
    return [distinct[k % len(distinct)] for k in range(count)] if distinct else [chunks] * count
