"""``bench serve``'s parts that need no server: its RAG dataset, the flood's requests,
the comparison against the targets, and the options the command hands the suite.

No timing is asserted; the suite itself runs at smoke size on a real server in
``tests/integration/with_vllm/test_vllm_api_servers.py``.
"""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path
from typing import Any

import pytest

from kvrag_integrations.bench import load_data, serve_load
from kvrag_integrations.bench.__main__ import parser, suite_options
from kvrag_integrations.bench.common import RagItem
from kvrag_integrations.bench.flood import KINDS, Flood

ITEMS = [
    RagItem(f"Question {i}?", [f"Passage {i}.{k} " + "word " * 20 for k in range(8)], [f"A{i}"])
    for i in range(5)
]
SETS = [item.chunks[:6] for item in ITEMS]


@pytest.mark.parametrize("concurrency", [1, 4, 16])
def test_requests_reorder_stored_passages_and_chats_follow_their_earlier_turns(
    concurrency: int,
) -> None:
    count = 64
    requests = load_data.rag_requests(
        ITEMS, SETS, count, chat_share=0.25, concurrency=concurrency, seed=concurrency
    )
    assert len(requests) == count
    chats = [r for r in requests if r.kind == "chat"]
    assert 0.15 * count <= len(chats) <= 0.3 * count
    for request in requests:
        stored = next(s for s in SETS if set(s) == set(request.passages))
        assert request.passages != stored  # a new order, every time
        system = request.messages[0]["content"]
        assert system.endswith("\n\n".join(request.passages))
    # a chat's later turn repeats its earlier one (and what was answered), and comes
    # more than `concurrency` requests after it
    for i, request in enumerate(requests):
        if request.kind == "chat":
            earlier = request.messages[:-2]
            before = [j for j, r in enumerate(requests[:i]) if r.messages == earlier]
            assert before and i - before[-1] == concurrency + 1
            assert request.messages[-2]["role"] == "assistant"


def test_the_dataset_is_vllms_custom_format(tmp_path: Path) -> None:
    class Template:
        def apply_chat_template(self, messages: list, **kwargs: Any) -> str:
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    requests = load_data.rag_requests(ITEMS, SETS, 6, seed=1)
    path = load_data.write_dataset(tmp_path / "load.jsonl", Template(), requests, 32)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 6 and all(set(line) == {"prompt", "output_tokens"} for line in lines)
    assert lines[0]["prompt"].startswith("<system>") and lines[0]["output_tokens"] == 32


def test_the_flood_asks_for_every_costly_thing_anew_each_time() -> None:
    class Tokenizer:
        def __call__(self, text: str) -> dict[str, list[int]]:
            return {"input_ids": [zlib.crc32(word.encode()) % 49152 for word in text.split()]}

    flood = Flood("http://unused", "model", SETS, Tokenizer())
    rng = random.Random(0)
    bodies = {kind: [flood.body(kind, rng) for _ in range(2)] for kind in KINDS}
    for kind, (first, second) in bodies.items():
        assert first != second, kind  # new each time: nothing cached by an earlier one
        assert "cache_salt" in first if kind == "salts" else "cache_salt" not in first
    assert bodies["beam"][0]["use_beam_search"] and bodies["beam"][0]["n"] > 1
    save = bodies["save"][0]
    assert save["kv_transfer_params"]["kvrag"]["save"] == [[0, len(save["prompt"]), []]]
    with pytest.raises(ValueError, match="unknown flood kind"):
        flood.body("nothing", rng)


def _run(rps: float, p50: float, p99: float) -> dict[str, float]:
    return {"request_throughput": rps, "median_ttft_ms": p50, "p99_ttft_ms": p99}


def test_the_summary_holds_each_figure_against_its_target() -> None:
    measured = {
        "kvrag": {
            "runs": {1: _run(2.0, 100, 200), 4: _run(5.0, 100, 300)},
            "flood": {"run": _run(4.0, 120, 420)},
        },
        "plain": {"runs": {1: _run(0.5, 400, 900), 4: _run(0.5, 2000, 1000)}},
    }
    summary = serve_load.summarize(measured, [1, 4], flood_at=4)
    at_1, at_4 = summary["by_concurrency"][1], summary["by_concurrency"][4]
    assert at_1["ratios"] == {"requests_per_s": 4.0, "ttft_p50": 4.0, "ttft_p99": 4.5}
    assert at_1["target"] == 2.0 and at_1["met"]
    # 10x in requests/s and TTFT p50, 3.3x at p99: short of 5x
    assert at_4["target"] == 5.0 and not at_4["met"]
    assert summary["flood"]["kvrag"] == {"p99_ratio": 1.4, "within": True}
    assert "plain" not in summary["flood"]


def test_the_command_hands_its_options_to_the_suite() -> None:
    args = parser().parse_args(
        [
            *("serve", "--concurrencies", "1,4", "--requests", "3", "--flood-concurrency", "0"),
            *("--api-server-count", "2", "--chunks", "4", "--max-new-tokens", "8"),
            *("--flood-kinds", "prefix,beam", "--servers", "kvrag"),
        ]
    )
    options = suite_options(serve_load, args)
    assert options == {
        "concurrencies": [1, 4],
        "requests": 3,
        "flood_concurrency": 0,
        "flood_kinds": ["prefix", "beam"],
        "servers": ["kvrag"],
        "api_server_count": 2,
        "n_chunks": 4,
        "max_new_tokens": 8,
    }


def test_an_unknown_flood_kind_or_server_is_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="'typo'"):
        serve_load.run(None, [], flood_kinds=["prefix", "typo"])
    with pytest.raises(ValueError, match="'vllm'"):
        serve_load.run(None, [], servers=["vllm"])
