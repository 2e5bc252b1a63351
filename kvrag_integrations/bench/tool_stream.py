"""Tool calls streamed: CPU time of every family's streaming detector on a long argument.

No model: for each family, one call in its own format whose string argument
is ``lengths`` KB of text (``--lengths``) is fed to the family's ``ContentDetector`` as a stream
sees it, growing ``step`` characters at a time (about a token), with the
request's stop-string search beside it, as ``engine.tool_answers`` runs them
between tokens. The figure is the CPU time (``time.process_time``) of the
whole stream: linear in its length where each character is read once (issue
58 found the bare-JSON and pythonic detectors re-reading the answer at every
token: 1.0 s for 10 KB, 20.5 s for 40 KB). Each row also checks the stream
against invoke: nothing streamed as text, and ``parse`` reads the one call with
its whole argument.

Examples:
    python -m kvrag_integrations.bench tools --out /tmp/bench-tools
"""

from __future__ import annotations

import json
import time
from typing import Any

from kvrag_integrations.bench.common import markdown_table
from kvrag_integrations.engine.modeling.generate import StopScanner
from kvrag_integrations.engine.tools.family import ToolFamily
from kvrag_integrations.engine.tools.hermes import FallbackFamily, HermesFamily
from kvrag_integrations.engine.tools.llama import LlamaFamily
from kvrag_integrations.engine.tools.mistral import MistralFamily
from kvrag_integrations.engine.tools.pythonic import PythonicFamily

QUICK = {"lengths": [1, 10]}
NAMES = ("search", "get_weather")
STOPS = ["</s>", "\nObservation:"]  # what agents pass; searched as tool_answers does


def calls(argument: str) -> dict[str, tuple[ToolFamily, str]]:
    """One call to ``search`` with ``argument`` in each family's format."""
    obj = json.dumps({"name": "search", "arguments": {"q": argument}})
    llama = json.dumps({"name": "search", "parameters": {"q": argument}})
    return {
        "hermes": (HermesFamily(), f"<tool_call>\n{obj}\n</tool_call>"),
        "fallback": (FallbackFamily(), f"<tool_call>\n{obj}\n</tool_call>"),
        "llama (bare)": (LlamaFamily(), llama),
        "llama (python_tag)": (LlamaFamily(), "<|python_tag|>" + llama),
        "mistral (v3)": (MistralFamily(), f"[TOOL_CALLS][{obj}]"),
        "mistral (v11)": (
            MistralFamily(),
            "[TOOL_CALLS]search[ARGS]" + json.dumps({"q": argument}),
        ),
        "pythonic": (PythonicFamily(), f"[search(q={json.dumps(argument)})]"),
        "json": (ToolFamily(), obj),
    }


def stream_cpu_s(family: ToolFamily, answer: str, step: int) -> tuple[float, bool]:
    """CPU seconds to stream ``answer`` through the family's detector ``step``
    characters at a time, and whether nothing streamed as text."""
    scanner = StopScanner(STOPS)
    started = time.process_time()
    detector = family.detector(NAMES)
    text, streamed, searched = "", 0, 0
    for at in range(0, len(answer), step):
        text += answer[at : at + step]
        if scanner.find(text, max(0, searched - scanner.hold)) >= 0:
            break
        searched = len(text)
        held = len(text) - scanner.safe_len(text, 0)
        streamed = max(streamed, min(detector.end(text), len(text) - held))
    return time.process_time() - started, streamed == 0


def run(
    engine: Any = None,
    items: Any = None,
    *,
    lengths: list[int] | None = None,
    step: int = 4,
) -> dict[str, Any]:
    """The figures above for arguments of ``lengths`` KB (``engine`` and ``items``
    are not used: the suite needs no model)."""
    rows = []
    for kb in lengths or [10, 20, 40, 100]:
        argument = ("The tower was completed in 1889. " * (kb * 32 + 1))[: kb * 1024]
        for name, (family, answer) in calls(argument).items():
            cpu_s, none_streamed = stream_cpu_s(family, answer, step)
            parsed = family.parse(answer, NAMES)
            read = [(c.name, c.arguments) for c in parsed.calls]
            rows.append(
                {
                    "family": name,
                    "argument_kb": kb,
                    "answer_chars": len(answer),
                    "cpu_s": cpu_s,
                    "equals_invoke": none_streamed and read == [("search", {"q": argument})],
                }
            )
    return {"step_chars": step, "stops": STOPS, "rows": rows}


def table(payload: dict[str, Any]) -> str:
    """Families down, argument sizes across: CPU seconds of the stream."""
    sizes = sorted({r["argument_kb"] for r in payload["rows"]})
    families = list(dict.fromkeys(r["family"] for r in payload["rows"]))
    cell = {(r["family"], r["argument_kb"]): r for r in payload["rows"]}
    headers = ["family", *(f"{kb} KB (CPU s)" for kb in sizes), "stream = invoke"]
    rows = [
        [
            family,
            *(cell[family, kb]["cpu_s"] for kb in sizes),
            all(cell[family, kb]["equals_invoke"] for kb in sizes),
        ]
        for family in families
    ]
    return "\n".join(
        [
            markdown_table(headers, rows),
            "",
            f"One call whose string argument is the size given, fed to the family's "
            f"streaming detector {payload['step_chars']} characters at a time with the "
            f"stop-string search beside it; CPU seconds for the whole stream.",
        ]
    )
