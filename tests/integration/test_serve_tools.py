"""``python -m kvrag_integrations.vllm.serve`` passes vLLM's tool-calling flags through,
and its packaged ChatML tool template renders what vLLM's Hermes parser reads."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from kvrag_integrations.vllm.server import command as serve

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "retrieve_context",
            "description": "Retrieve information to help answer a query.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]


def command(capsys: pytest.CaptureFixture[str], *extra: str) -> list[str]:
    serve.main(["--store", "disk:/tmp/kvrag-serve-args", "--print-command", *extra])
    return shlex.split(capsys.readouterr().out)


def test_tool_flags_reach_vllm_and_a_packaged_template_is_resolved(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    flags += ["--tool-parser-plugin", "/srv/parsers.py", "--chat-template", "chatml-tools"]
    got = command(capsys, *flags)
    assert got[got.index("--tool-call-parser") + 1] == "hermes"
    assert got[got.index("--tool-parser-plugin") + 1] == "/srv/parsers.py"
    assert "--enable-auto-tool-choice" in got
    template = Path(got[got.index("--chat-template") + 1])
    assert template.is_file() and template.name == "chatml_tools.jinja"
    # the connector still there
    assert "kvrag_integrations.vllm.server.gateway.TenantGateway" in got
    # a file or template string of the caller's own goes to vLLM untouched
    got = command(capsys, "--", "--chat-template=/srv/mine.jinja")
    assert "--chat-template=/srv/mine.jinja" in got and "--" not in got


def test_the_packaged_template_renders_hermes_tool_calls_and_responses() -> None:
    from transformers import AutoTokenizer

    from kvrag_integrations.model_files import checkpoint_folder

    tokenizer = AutoTokenizer.from_pretrained(checkpoint_folder(None)[0])
    template = Path(serve.chat_template_path("chatml-tools")).read_text()
    call = {"name": "retrieve_context", "arguments": json.dumps({"query": "Who wrote it?"})}
    messages = [
        {"role": "system", "content": "Use the tool."},
        {"role": "user", "content": "Who wrote it?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": call}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Source: {}\nContent: A poem."},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nUse the tool.") and "retrieve_context" in system
    # the call as vLLM's hermes parser reads one: JSON between <tool_call> tags
    calls = re.findall(r"<tool_call>(.*?)</tool_call>", text.split("</tools>")[-1], re.DOTALL)
    parsed = [json.loads(c) for c in calls if c.strip().startswith('{"name": "retrieve')]
    assert parsed == [{"name": "retrieve_context", "arguments": {"query": "Who wrote it?"}}]
    response = "<tool_response>\nSource: {}\nContent: A poem.\n</tool_response>"
    assert f"<|im_start|>user\n{response}<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # without tools it is the model's own ChatML
    plain = tokenizer.apply_chat_template(messages[:2], chat_template=template, tokenize=False)
    assert plain == tokenizer.apply_chat_template(messages[:2], tokenize=False)
