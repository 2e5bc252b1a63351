"""``family_for`` on vLLM's own tool templates: the family vLLM's parser for each reads.

Every ``examples/tool_chat_template_*.jinja`` of vLLM 0.32.0, verbatim
(``vllm_tool_templates/``, provenance in its README), is a tokenizer's chat
template here, and ``family_for`` must pick the family that reads the call
syntax of the parser vLLM serves that template with (``--tool-call-parser``,
from vLLM's ``docs/features/tool_calling.md`` and ``tests/tool_use``).
Templates whose parser reads a format no family here reads (DeepSeek's
special tokens, Granite's ``<|tool_call|>`` lists, Qwen3-Coder's XML, ...)
get the bare-JSON default, which turns none of their markup into calls. A
template is matched by its call syntax, never by a word it holds for another
reason: Llama 3.2's pythonic template has the ``ipython`` role of Llama's JSON
templates, Hermes' has their ``"parameters"`` in its tool list, GLM's and
Qwen3-Coder's have ``<tool_call>`` opening no JSON.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from kvrag_integrations.engine.tools.plan import family_for
from kvrag_integrations.engine.tools.pythonic import PythonicFamily

TEMPLATES = Path(__file__).parent / "vllm_tool_templates"

# template (examples/tool_chat_template_<name>.jinja): SHA-256 (first 16 hex digits),
# vLLM's --tool-call-parser for it, the family family_for must pick
TABLE = {
    "apertus": ("ae354cfceb686cdb", "apertus", "json"),
    "deepseekr1": ("fe055ac311d9124c", "deepseek_v3", "json"),
    "deepseekv3": ("76233095fd644a62", "deepseek_v3", "json"),
    "deepseekv31": ("8b99b81c2f0d3ab0", "deepseek_v31", "json"),
    "functiongemma": ("9d60691c7f5e3fe6", "functiongemma", "json"),
    "gemma3_pythonic": ("659a5b7f8c93ba63", "pythonic", "pythonic"),
    "gemma4": ("afdbb2abe3667ccd", "gemma4", "json"),
    "glm4": ("0719a4c065b07352", "glm45", "json"),
    "granite": ("4ae5bbdb15115852", "granite", "json"),
    "granite_20b_fc": ("4bb42dac7699af82", "granite-20b-fc", "json"),
    "hermes": ("9d08161b0665b9d3", "hermes", "hermes"),
    "hunyuan_a13b": ("05d3f879ab204075", "hunyuan_a13b", "json"),
    "internlm2_tool": ("e00f16381b76d36b", "internlm", "json"),
    "llama3.1_json": ("8aedd05f7ab549b8", "llama3_json", "llama"),
    "llama3.2_json": ("c22af47e53f44425", "llama3_json", "llama"),
    "llama3.2_pythonic": ("a4958a09420919b8", "pythonic", "pythonic"),
    "llama4_json": ("c5d275e741705515", "llama4_json", "llama"),
    "llama4_pythonic": ("3fe950790d033a6e", "llama4_pythonic", "pythonic"),
    "mistral": ("0121272d0fe4c382", "mistral", "mistral"),
    "mistral3": ("a53352b09d6ecea6", "mistral", "mistral"),
    "mistral_parallel": ("0b4dd7ac0ba2c78c", "mistral", "mistral"),
    "muse_glimmer": ("a3e32125a1642d0f", "muse_glimmer", "json"),
    "phi4_mini": ("b79920e63d66e055", "phi4_mini_json", "json"),
    "qwen3coder": ("5a38bfa058332662", "qwen3_coder", "json"),
    "toolace": ("b9ded9033e0fe544", "pythonic", "pythonic"),
    "xlam_llama": ("777a5f5ca9ed21c5", "xlam", "json"),
    "xlam_qwen": ("1d41a6a1069756ec", "xlam", "json"),
}


class Tokenizer:
    """What ``family_for`` reads of a tokenizer: its chat template."""

    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template


def _template(name: str) -> str:
    path = TEMPLATES / f"tool_chat_template_{name}.jinja"
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest()[:16] == TABLE[name][0], f"{path.name} is not verbatim"
    return data.decode()


def test_the_table_holds_every_template_kept() -> None:
    kept = {
        p.name.removeprefix("tool_chat_template_").removesuffix(".jinja")
        for p in TEMPLATES.glob("*.jinja")
    }
    assert kept == set(TABLE)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_each_vllm_template_gets_the_family_its_parser_reads(name: str) -> None:
    _, parser, family = TABLE[name]
    assert family_for(Tokenizer(_template(name))).name == family, parser


def test_llama_3_2s_pythonic_template_reads_its_python_calls() -> None:
    """The issue's case: the template holds ``ipython`` and ``func_name1(``; its
    answers are Python call lists, which stayed text under the Llama family."""
    family = family_for(Tokenizer(_template("llama3.2_pythonic")))
    assert isinstance(family, PythonicFamily)
    parsed = family.parse('[get_weather(city="Paris")]', ["get_weather"])
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]
    assert parsed.content == ""
