"""Tool calling per family: each family's real template on a tiny model of its architecture.

For Qwen2.5 (Hermes), Llama 3.1, Mistral (v3) and Gemma 3 (vLLM's pythonic
tool template), a tiny random model is built from the family's config class,
with the bundled SmolLM2 tokenizer given the family's control tokens (as
special tokens, like the family's own tokenizer) and the family's real chat
template (``tool_templates``). Through ``KVRAGEngine`` in process:

- the tools are rendered by that template, and the agent's second call
  (system, user, assistant with ``tool_calls``, tool) renders exactly as the
  template renders it, the tool's document kept as a chunk read from its cache;
- the first token's logits equal transformers' own forward of the prompt;
- canned outputs in the family's format, decoded from its tokens with special
  tokens, parse into calls; a forced call from the random model parses and
  goes back through the template as the next call's history.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch
import transformers
from corpus import SEARCH_TOOL, TOWER
from test_families import BASE
from tool_templates import GEMMA3_PYTHONIC, GEMMA_IT, LLAMA31, MISTRAL_V3, QWEN25

from kvrag_integrations import Chunk, KVRAGEngine
from kvrag_integrations.engine.modeling.layout import ModelLayout
from kvrag_integrations.engine.modeling.model import LoadedModel, model_fingerprint
from kvrag_integrations.engine.tool_answers import AnswerText
from kvrag_integrations.engine.tools.hermes import FallbackFamily, HermesFamily
from kvrag_integrations.engine.tools.llama import LlamaFamily
from kvrag_integrations.engine.tools.mistral import MistralFamily, mistral_call_id
from kvrag_integrations.engine.tools.plan import plan_tools
from kvrag_integrations.engine.tools.pythonic import PythonicFamily

LLAMA_MORE = ["<|eom_id|>", "<|python_tag|>"]
MISTRAL_MORE = ["[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
GEMMA = {"head_dim": 16, "sliding_window": 4096, "query_pre_attn_scalar": 16}
GEMMA_TOKENS = (["<bos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<end_of_turn>")
# family -> (config class, config extras, template, control tokens, bos, eos, tool family)
FAMILIES: dict[str, tuple[str, dict[str, Any], str, list[str], str | None, str, Any]] = {
    "qwen2.5": ("Qwen2Config", {}, QWEN25, [], None, "<|im_end|>", HermesFamily),
    "llama3.1": (
        "LlamaConfig",
        {},
        LLAMA31,
        [
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            *LLAMA_MORE,
        ],
        "<|begin_of_text|>",
        "<|eot_id|>",
        LlamaFamily,
    ),
    "mistral": (
        "MistralConfig",
        {"sliding_window": 4096},
        MISTRAL_V3,
        [
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            *MISTRAL_MORE,
        ],
        "<s>",
        "</s>",
        MistralFamily,
    ),
    # the template renders Python calls (a forced call is the constraint's JSON)
    "gemma3": ("Gemma3TextConfig", GEMMA, GEMMA3_PYTHONIC, *GEMMA_TOKENS, PythonicFamily),
}
# Google's Gemma template: no tools (the fallback prompt), no system or tool role.
GEMMA_NO_TOOLS = ("Gemma2Config", GEMMA, GEMMA_IT, *GEMMA_TOKENS, FallbackFamily)

CALL_ID = "call_0123456789abcdef"  # OpenAI's form, as an agent sends it back
SYSTEM = "Answer from the documents."
SECOND_CALL = [  # LangChain's create_agent, second model call
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "When was the tower built?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": CALL_ID,
                "type": "function",
                "function": {"name": "search", "arguments": '{"query": "tower"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": CALL_ID, "content": TOWER},
]

_ENGINES: dict[str, KVRAGEngine] = {}


def _engine(family: str, base: transformers.PreTrainedTokenizerBase) -> KVRAGEngine:
    spec = GEMMA_NO_TOOLS if family == "gemma-it" else FAMILIES[family]
    config_name, extra, template, controls, bos, eos, _ = spec
    tok = copy.deepcopy(base)
    specials: dict[str, Any] = {"eos_token": eos}
    if controls:
        specials["additional_special_tokens"] = controls
    if bos is not None:
        specials["bos_token"] = bos
    tok.add_special_tokens(specials)
    tok.chat_template = template
    config = getattr(transformers, config_name)(  # test_families' tiny shape, 2 layers
        **{
            **BASE,
            "vocab_size": len(tok),
            "num_hidden_layers": 2,
            "max_position_embeddings": 2048,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "tie_word_embeddings": True,
            **extra,
        }
    )
    torch.manual_seed(0)
    attn = {"attn_implementation": "eager"} if config_name == "Gemma2Config" else {}
    lm = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, **attn)
    lm.eval()
    fp = model_fingerprint(lm, tok, torch.float32)
    loaded = LoadedModel(
        lm, tok, f"tiny-{family}", fp, torch.device("cpu"), torch.float32, ModelLayout.of(lm)
    )
    return KVRAGEngine(loaded, on_miss="encode", cache_precision="model")


def _cached(name: str, tiny_loaded: LoadedModel) -> KVRAGEngine:
    if name not in _ENGINES:
        _ENGINES[name] = _engine(name, tiny_loaded.tokenizer)
    return _ENGINES[name]


@pytest.fixture(params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tiny_loaded: LoadedModel) -> tuple[str, KVRAGEngine]:
    return request.param, _cached(request.param, tiny_loaded)


def _text(engine: KVRAGEngine, messages: list[dict[str, Any]]) -> tuple[str, list]:
    return _text_of(engine, messages, [TOWER])


def _text_of(
    engine: KVRAGEngine, messages: list[dict[str, Any]], known: list[str]
) -> tuple[str, list]:
    plan = plan_tools(engine.tokenizer, [SEARCH_TOOL], None)
    segs = engine.build_segments(messages=messages, known_chunks=known, tools=plan)
    return "".join(s.text for s in segs), segs


# How each template writes the tool list, an earlier call and its result.
def _expected(family: str) -> tuple[str, str, str]:
    mid = mistral_call_id(CALL_ID)
    return {
        "qwen2.5": (
            f"<tools>\n{json.dumps(SEARCH_TOOL)}\n</tools>",
            '<tool_call>\n{"name": "search", "arguments": {"query": "tower"}}\n</tool_call>',
            f"<|im_start|>user\n<tool_response>\n{TOWER}\n</tool_response><|im_end|>",
        ),
        "llama3.1": (
            json.dumps(SEARCH_TOOL, indent=4) + "\n\n",
            '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "search", '
            '"parameters": {"query": "tower"}}<|eot_id|>',
            f'<|start_header_id|>ipython<|end_header_id|>\n\n"{TOWER}"<|eot_id|>',
        ),
        "mistral": (
            '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "search", '
            '"description": "Search the documents.", "parameters": '
            + json.dumps(SEARCH_TOOL["function"]["parameters"])
            + "}}][/AVAILABLE_TOOLS]",
            '[TOOL_CALLS] [{"name": "search", "arguments": {"query": "tower"}, '
            f'"id": "{mid}"}}]</s>',
            f'[TOOL_RESULTS] {{"content": {TOWER}, "call_id": "{mid}"}}[/TOOL_RESULTS]',
        ),
        "gemma3": (
            "you must respond with a python list of the function calls.\n"
            + "Example Format: [func_name1(params_name1=params_value1, "
            + "params_name2=params_value2...), func_name2(params)] \n",
            '<start_of_turn>model\n[search(query="tower")]<end_of_turn>\n',
            f"<start_of_turn>user\n<tool_response>\n{TOWER}</tool_response><end_of_turn>\n",
        ),
    }[family]


def test_the_familys_template_renders_the_tools(family: tuple[str, KVRAGEngine]) -> None:
    name, engine = family
    assert type(plan_tools(engine.tokenizer, [SEARCH_TOOL], None).family) is FAMILIES[name][-1]
    text, _ = _text(engine, SECOND_CALL[:2])
    assert _expected(name)[0] in text
    assert SYSTEM in text


def test_the_agents_second_call_renders_as_the_template_does_with_the_document_a_chunk(
    family: tuple[str, KVRAGEngine],
) -> None:
    name, engine = family
    text, segs = _text(engine, SECOND_CALL)
    _, call, result = _expected(name)
    assert call in text and result in text
    assert Chunk(TOWER) in segs  # the tool's document keeps its stored cache's identity
    # The prompt is the template's own rendering of the messages agents send
    # (arguments as a dict, Mistral's ids in its 9-character form).
    own = copy.deepcopy(SECOND_CALL)
    own[2]["tool_calls"][0]["function"]["arguments"] = {"query": "tower"}
    if name == "mistral":
        own[2]["tool_calls"][0]["id"] = own[3]["tool_call_id"] = mistral_call_id(CALL_ID)
    assert text == engine.tokenizer.apply_chat_template(
        own, tools=[SEARCH_TOOL], tokenize=False, add_generation_prompt=True
    )


def test_the_second_call_is_exact_and_reads_the_document_from_its_cache(
    family: tuple[str, KVRAGEngine],
) -> None:
    _, engine = family
    kw = dict(messages=SECOND_CALL, known_chunks=[TOWER], tools=[SEARCH_TOOL], max_new_tokens=1)
    full = engine.generate(strategy="full", **kw)
    plan = plan_tools(engine.tokenizer, [SEARCH_TOOL], None)
    segs = engine.build_segments(messages=SECOND_CALL, known_chunks=[TOWER], tools=plan)
    ids = engine.tokenize(segs).input_ids
    with torch.no_grad():
        own = engine.model(input_ids=ids.unsqueeze(0)).logits[0, -1].float()
    assert own.abs().max() > 0.5
    torch.testing.assert_close(full.first_token_logits, own, atol=1e-4, rtol=0)
    # Reuse reads the document's tokens from its stored cache (turbo against the
    # block-masked forward, per architecture: test_families.py).
    engine.encode_chunks([TOWER])  # ingested, as a retriever's documents are
    turbo = engine.generate(strategy="turbo", **kw)
    assert turbo.reused_chunk_tokens >= engine.tokenize([Chunk(TOWER)]).num_tokens
    assert turbo.prompt_tokens == ids.numel()


# Canned outputs in each family's own format (as its vLLM tool parser reads it).
CANNED = {
    "qwen2.5": '<tool_call>\n{"name": "search", "arguments": {"query": "a"}}\n</tool_call>',
    "llama3.1": '<|python_tag|>{"name": "search", "parameters": {"query": "a"}}',
    "mistral": '[TOOL_CALLS] [{"name": "search", "arguments": {"query": "a"}, "id": "a1B2c3D4e"}]',
    "gemma3": '[search(query="a")]',
}


def test_canned_outputs_decoded_from_the_familys_tokens_parse(
    family: tuple[str, KVRAGEngine],
) -> None:
    name, engine = family
    tok = engine.tokenizer
    family = plan_tools(tok, [SEARCH_TOOL], None).family
    ids = tok(CANNED[name], add_special_tokens=False)["input_ids"]
    decoded = AnswerText(tok, family.answer_markup).text(ids, final=True)  # as tool_answers reads
    parsed = family.parse(decoded, ["search"])
    calls = parsed.calls
    assert [(c.name, c.arguments) for c in calls] == [("search", {"query": "a"})]
    assert parsed.content == ""
    if name == "mistral":
        assert calls[0].id == "a1B2c3D4e"  # Mistral's own id is kept


@pytest.mark.parametrize(
    "answer",
    [
        '[TOOL_CALLS]search[CALL_ID]a1B2c3D4e[ARGS]{"query": "a"}',  # v11
        '[TOOL_CALLS]search[ARGS]{"query": "a"}',  # v13: no call id
    ],
    ids=["v11", "v13"],
)
def test_mistral_v11_calls_decoded_from_their_special_tokens_parse(
    answer: str, tiny_loaded: LoadedModel
) -> None:
    tok = copy.deepcopy(tiny_loaded.tokenizer)
    specials = ["[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"]  # special, as in Mistral's tekken
    tok.add_special_tokens({"additional_special_tokens": specials})
    ids = tok(answer, add_special_tokens=False)["input_ids"]
    assert "[ARGS]" not in tok.decode(ids, skip_special_tokens=True)  # plain text drops it
    family = MistralFamily()
    parsed = family.parse(AnswerText(tok, family.answer_markup).text(ids, final=True), ["search"])
    assert [(c.name, c.arguments) for c in parsed.calls] == [("search", {"query": "a"})]
    assert parsed.content == "" and not parsed.invalid


def test_a_forced_call_parses_and_goes_back_through_the_template(
    family: tuple[str, KVRAGEngine],
) -> None:
    _, engine = family
    result = engine.generate(
        messages=SECOND_CALL[:2], tools=[SEARCH_TOOL], tool_choice="required", max_new_tokens=8
    )
    assert [c.name for c in result.tool_calls] == ["search"]
    assert isinstance(result.tool_calls[0].arguments["query"], str)
    # The agent's next call: the call as OpenAI's tool_calls item, then its result.
    call = result.tool_calls[0].as_openai()
    history = [
        *SECOND_CALL[:2],
        {"role": "assistant", "content": result.text, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": TOWER},
    ]
    text, segs = _text(engine, history)
    assert Chunk(TOWER) in segs
    assert json.dumps(result.tool_calls[0].arguments["query"], ensure_ascii=False)[1:-1] in text


def test_a_tool_result_the_template_escapes_is_its_text_not_a_chunk(
    tiny_loaded: LoadedModel,
) -> None:
    """Llama 3.1 writes a tool result as a JSON string: a document with a newline
    or a quote comes out escaped, so it cannot be its stored cache's tokens. It is
    then written in place (not reused) and the prompt is still the template's own."""
    engine = _cached("llama3.1", tiny_loaded)
    doc = 'The "Iron Lady" was finished in 1889.\nIt is 330 m tall.'
    messages = copy.deepcopy(SECOND_CALL)
    messages[3]["content"] = doc
    text, segs = _text_of(engine, messages, [doc, TOWER])
    assert Chunk(doc) not in segs
    assert json.dumps(doc) in text
    own = copy.deepcopy(messages)
    own[2]["tool_calls"][0]["function"]["arguments"] = {"query": "tower"}
    assert text == engine.tokenizer.apply_chat_template(
        own, tools=[SEARCH_TOOL], tokenize=False, add_generation_prompt=True
    )
    # The same document in the user's message (not escaped there) stays a chunk.
    messages[1]["content"] = doc
    _, segs = _text_of(engine, messages[:2], [doc])
    assert Chunk(doc) in segs


def test_a_template_without_tools_system_or_tool_roles_takes_the_agents_second_call(
    tiny_loaded: LoadedModel,
) -> None:
    """Google's Gemma template has no tools and raises on a system or tool message:
    the fallback prompt and system text lead the first user turn, and the tool's
    result is a user turn of ``<tool_response>`` (the fallback format's), the
    document still a chunk; the prompt is the template's rendering of that."""
    engine = _cached("gemma-it", tiny_loaded)
    assert type(plan_tools(engine.tokenizer, [SEARCH_TOOL], None).family) is FallbackFamily
    text, segs = _text(engine, SECOND_CALL)
    assert text.startswith(f"<start_of_turn>user\n{SYSTEM}\n\nYou may call one or more functions")
    call = '<tool_call>\n{"name": "search", "arguments": {"query": "tower"}}\n</tool_call>'
    assert f"<start_of_turn>model\n{call}<end_of_turn>\n" in text
    result = f"<start_of_turn>user\n<tool_response>\n{TOWER}\n</tool_response><end_of_turn>\n"
    assert text.endswith(result + "<start_of_turn>model\n")
    assert Chunk(TOWER) in segs
    system = f"{SYSTEM}\n\n{FallbackFamily.system_text([SEARCH_TOOL])}"
    own = [
        {"role": "user", "content": f"{system}\n\n{SECOND_CALL[1]['content']}"},
        {"role": "assistant", "content": call},
        {"role": "user", "content": f"<tool_response>\n{TOWER}\n</tool_response>"},
    ]
    assert text == engine.tokenizer.apply_chat_template(
        own, tokenize=False, add_generation_prompt=True
    )
    forced = engine.generate(
        messages=SECOND_CALL, tools=[SEARCH_TOOL], tool_choice="search", max_new_tokens=6
    )
    assert [c.name for c in forced.tool_calls] == ["search"]
