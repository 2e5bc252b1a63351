"""bench openai's arithmetic without servers: the KL it reports, the summary, the table."""

from __future__ import annotations

import math

from kvrag_integrations.bench.metrics import kl_top
from kvrag_integrations.bench.openai_clients import _summary, table


def test_kl_over_the_exact_top_tokens() -> None:
    exact = {"a": math.log(0.6), "b": math.log(0.3)}
    assert kl_top(exact, exact) == 0.0
    shifted = {"a": math.log(0.3), "b": math.log(0.6)}
    want = 0.6 * math.log(0.6 / 0.3) + 0.3 * math.log(0.3 / 0.6)
    assert math.isclose(kl_top(exact, shifted), want)
    # a token missing from the approximate top list counts as its smallest entry
    assert math.isclose(kl_top(exact, {"a": math.log(0.6)}), 0.3 * (math.log(0.3) - math.log(0.6)))
    assert math.isnan(kl_top({}, exact))


def record(cached: int, latency: float, top: dict | None = None) -> dict:
    return {"prompt_tokens": 100, "cached": cached, "latency_s": latency, "top": top or {"x": 0.0}}


def test_summary_and_table_from_both_servers() -> None:
    def runs(cached: int, second_s: float) -> dict:
        pair = {"first": {**record(0, 2.0), "learned_after_s": 0.2}}
        pair["second"] = record(cached, second_s)
        return {
            "langchain": [pair, pair, pair],
            "llama_index": [pair],
            "ingested": [{"first": record(95, 0.1)}],
            "probes": {"opted_out": {"x": -1.0}, "no_passage": {"y": -2.0}},
        }

    ours, plain = runs(99, 0.1), runs(0, 2.0)
    ours["turbo_kl"] = [0.05]
    summary = _summary({"kvrag": ours, "plain": plain}, 4, 3)
    lc = summary["frameworks"]["langchain"]
    assert lc["cached_share_second"] == 0.99 and lc["cached_share_second_plain"] == 0.0
    assert math.isclose(lc["speedup"], 20.0) and summary["ingested_first_request_share"] == 0.95
    assert summary["exactness"] == {"opted_out": 0.0, "no_passage": 0.0}
    assert summary["fidelity"]["detected_kl_median"] == 0.0
    text = table(summary)
    assert "| langchain | 100 | 99.0% | 0.0% | 100 | 2000 | 20.0x | 2000 / 2000 |" in text
