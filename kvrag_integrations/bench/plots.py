"""PNG charts of suite results (matplotlib, headless), written next to the JSON.

Each function takes a suite's payload and a file path and returns the path.
matplotlib is an optional dependency (the ``bench`` extra); suites skip their
plots with a warning when it is missing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

COLORS = {"full": "#4c4c4c", "turbo": "#1f77b4", "floor": "#2ca02c", "hf": "#9467bd"}
_BLEND_COLORS = ["#ff7f0e", "#d62728", "#8c564b", "#e377c2"]


def available() -> bool:
    """Whether matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        logger.warning("matplotlib is missing (pip install 'kvrag-integrations[bench]'): no plots")
        return False
    return True


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def color(name: str, index: int = 0) -> str:
    """One color per strategy name (blend variants cycle through warm colors)."""
    name = name.removeprefix("KVRAGLLM ")
    if name.startswith("HuggingFace"):
        return COLORS["hf"]
    for key, value in COLORS.items():
        if name.startswith(key):
            return value
    return _BLEND_COLORS[index % len(_BLEND_COLORS)]


def _subtitle(payload: dict[str, Any]) -> str:
    m = payload.get("machine", {})
    where = m.get("gpu") or f"{m.get('cpu', '?')} ({m.get('cpu_threads', '?')} threads)"
    return f"{m.get('model', '?')}, {m.get('dtype', '?')}, {where}"


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def ttft_bars(
    payload: dict[str, Any], path: Path, title: str = "Time to first token by strategy"
) -> Path:
    """Bars of median TTFT per strategy, each labelled with its speedup over full."""
    plt = _pyplot()
    rows = payload["results"]
    names = [r["strategy"] for r in rows]
    values = [r["ttft_ms"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, values, color=[color(n, i) for i, n in enumerate(names)])
    for bar, row in zip(bars, rows):
        note = f"{row['speedup']:.1f}x" if "speedup" in row else f"{bar.get_height():.0f}"
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                    va="bottom", fontsize=9)  # fmt: skip
    ax.set_ylabel("TTFT (ms, median)")
    ax.set_title(f"{title}\n{_subtitle(payload)}", fontsize=10)
    ax.tick_params(axis="x", labelrotation=20)
    ax.margins(y=0.12)
    return _save(fig, path)


def scaling_lines(payload: dict[str, Any], path: Path, sweep: str) -> Path:
    """TTFT against the swept variable (``"chunks"`` or ``"length"``), one line per strategy.

    The query-only floor (only the question's tokens computed over a ready
    cache) is drawn dashed.
    """
    plt = _pyplot()
    points = payload[sweep]
    x_key = "n_chunks" if sweep == "chunks" else "chunk_tokens"
    xs = [p[x_key] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    strategies = list(points[0]["ttft_ms"]) if points else []
    for i, name in enumerate(strategies):
        ys = [p["ttft_ms"][name] for p in points]
        ax.plot(xs, ys, marker="o", label=name, color=color(name, i))
    ax.plot(xs, [p["floor_ms"] for p in points], linestyle="--", marker=".",
            color=COLORS["floor"], label="query-only floor")  # fmt: skip
    _log_axes(ax, xs)
    if sweep == "chunks":
        ax.set_xlabel(f"chunks in the prompt ({payload['chunk_tokens']} tokens each)")
        title = "TTFT vs number of chunks"
    else:
        ax.set_xlabel(f"tokens per chunk ({payload['n_chunks']} chunks)")
        title = "TTFT vs chunk length"
    ax.set_ylabel("TTFT (ms, median, log scale)")
    ax.set_title(f"{title}\n{_subtitle(payload)}", fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=9)
    return _save(fig, path)


def ratio_of(row: dict[str, Any]) -> float | None:
    """A quality row's recompute ratio (older results lack the field: read the label).

    Examples:
        >>> ratio_of({"strategy": "blend@0.15"}), ratio_of({"strategy": "turbo"})
        (0.15, 0.0)
    """
    if row.get("recompute_ratio") is not None:
        return float(row["recompute_ratio"])
    name = row["strategy"]
    if name in ("turbo", "full"):
        return 0.0 if name == "turbo" else 1.0
    if name.startswith("blend@"):
        return float(name.removeprefix("blend@"))
    return None


def quality_tradeoff(payload: dict[str, Any], path: Path) -> Path:
    """The CacheBlend trade-off: KL and top-1 agreement against the recompute ratio.

    turbo sits at ratio 0 and full at 1; rows without a plain ratio (ablation
    variants) are left out.
    """
    plt = _pyplot()
    rows = sorted(
        (
            {**r, "recompute_ratio": ratio_of(r)}
            for r in payload["results"]
            if ratio_of(r) is not None
        ),
        key=lambda r: r["recompute_ratio"],
    )
    xs = [r["recompute_ratio"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, [r["kl_vs_full"] for r in rows], marker="o", color="#d62728",
            label="first-token KL(full || strategy)")  # fmt: skip
    ax.set_xlabel("recompute ratio (turbo = 0, full prefill = 1)")
    ax.set_ylabel("KL vs full (nats)", color="#d62728")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["top1_vs_full"] for r in rows], marker="s", color="#1f77b4",
             label="top-1 agreement with full")  # fmt: skip
    ax2.set_ylabel("top-1 agreement", color="#1f77b4")
    ax2.set_ylim(0, 1.05)
    for r in rows:
        ax.annotate(r["strategy"], (r["recompute_ratio"], r["kl_vs_full"]), fontsize=8,
                    textcoords="offset points", xytext=(4, 6))  # fmt: skip
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=9, loc="center right")
    ax.set_title(
        f"Quality vs recompute ratio (CacheBlend trade-off), {payload['items']} items\n"
        f"{_subtitle(payload)}",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def load_lines(payload: dict[str, Any], path: Path, labels: dict[str, str]) -> Path:
    """``bench serve``: requests/s and TTFT p50/p99 against concurrency, one line per
    server (log scales), the flooded run as a lone marker."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 5.6))
    tints = {"kvrag": COLORS["turbo"], "plain": COLORS["full"]}
    for kind, figures in payload["servers"].items():
        runs = sorted((int(c), r) for c, r in figures["runs"].items())
        xs = [c for c, _ in runs]
        tint = tints.get(kind)
        left.plot(xs, [r["request_throughput"] for _, r in runs], marker="o", color=tint,
                  label=labels.get(kind, kind))  # fmt: skip
        for stat, style in (("median", "-"), ("p99", "--")):
            ys = [r[f"{stat}_ttft_ms"] for _, r in runs]
            label = f"{labels.get(kind, kind)}, {stat.replace('median', 'p50')}"
            right.plot(xs, ys, linestyle=style, marker="o", color=tint, label=label)
        if "flood" in figures:
            flooded = [figures["flood"]["run"]["p99_ttft_ms"]]
            label = f"{labels.get(kind, kind)}, p99 beside the flood"
            right.plot([payload["flood_at"]], flooded, marker="x", color=tint,
                       linestyle="none", markersize=9, label=label)  # fmt: skip
    levels = sorted({int(c) for figures in payload["servers"].values() for c in figures["runs"]})
    for ax in (left, right):
        _log_axes(ax, levels)
        ax.set_xlabel("concurrent requests (vllm bench serve --max-concurrency)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    left.set_ylabel("requests/s")
    right.set_ylabel("TTFT (ms)")
    title = f"RAG load, {payload['n_chunks']} stored passages in a new order"
    fig.suptitle(f"{title}\n{_subtitle(payload)}", fontsize=10)
    return _save(fig, path)


def _log_axes(ax: Any, xs: list[int]) -> None:
    """Log axes: ``xs`` ticked on a base-2 x axis, the y decades labelled at 1, 2, 5."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.minorticks_off()
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
