"""What every benchmark suite shares: data, timing, machine facts, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
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
    import transformers

    info: dict[str, Any] = {
        "cpu": _cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    if engine is not None:
        info.update(
            model=engine.model_name,
            device=str(engine.device),
            dtype=str(engine.loaded.dtype).replace("torch.", ""),
        )
    return info


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
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    (out / f"{suite}.md").write_text(table + "\n")
    return path
