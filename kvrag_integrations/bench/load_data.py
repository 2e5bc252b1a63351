"""The RAG requests of ``bench serve``: a custom dataset for vLLM's serving benchmark.

Each request is a chat a RAG application sends: LangChain's RAG system message
(``openai_apps.system_prompt``) holding ``n_chunks`` stored passages of one
question in a new order, then a question; a share of them (``chat_share``) are
later turns of a chat (the passages, an earlier question and answer, a follow-up).
Requests are rendered with the served model's chat template, as its server would
render the messages, and written as vLLM's ``custom`` dataset (JSONL, one
``prompt`` a line: ``--dataset-name custom --skip-chat-template``, sent to
``/v1/completions``). A chat's next turn comes ``concurrency + 1`` lines after the
one before (``--disable-shuffle`` keeps the order), so it is sent once that turn
was, as a person's next message would be.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrag_integrations.bench.common import RagItem, trimmed_chunks
from kvrag_integrations.bench.openai_apps import system_prompt

# Questions a user asks of retrieved passages besides the dataset's own (held-out-like:
# no prompt of the run was sent before).
FOLLOW_UPS = [
    "Which people, places or works do these passages name?",
    "What do the passages say happened first?",
    "Summarize the passages in two sentences.",
    "Which of these passages answers the question best, and why?",
]
TURNS = 3  # a chat's turns: the first question, then follow-ups


@dataclass
class LoadRequest:
    """One request of the load: its chat messages, what kind it is, its passages."""

    messages: list[dict[str, str]]
    kind: str  # "rag" (one question) or "chat" (a later turn)
    passages: list[str]


def passage_sets(
    items: list[RagItem], tokenizer: Any, n_chunks: int, chunk_tokens: int | None
) -> list[list[str]]:
    """Each question's first ``n_chunks`` passages (cut to ``chunk_tokens`` tokens
    where given): what is stored before the load."""
    if chunk_tokens:
        return [trimmed_chunks(tokenizer, item, n_chunks, chunk_tokens) for item in items]
    return [item.chunks[:n_chunks] for item in items]


def _answer(item: RagItem) -> str:
    gold = item.answers[0] if item.answers else "not in the passages"
    return f"According to the passages, the answer is {gold}."


def rag_requests(
    items: list[RagItem],
    sets: list[list[str]],
    count: int,
    *,
    chat_share: float = 0.25,
    concurrency: int = 1,
    seed: int = 0,
) -> list[LoadRequest]:
    """``count`` requests over the passage ``sets`` (of ``items``), each set in a new
    order; about ``chat_share`` of them later turns of ``TURNS``-turn chats."""
    rng = random.Random(seed)
    chats = round(count * chat_share / (TURNS - 1))
    slots: list[LoadRequest | None] = [None] * count
    gap = concurrency + 1
    free = [i for i in range(count) if i + (TURNS - 1) * gap < count]
    rng.shuffle(free)
    for _ in range(chats):
        start = next((i for i in free if _fits(slots, i, gap)), None)
        if start is None:
            break
        k = rng.randrange(len(sets))
        for turn, request in enumerate(_chat(items[k], sets[k], rng)):
            slots[start + turn * gap] = request
    for i, slot in enumerate(slots):
        if slot is None:
            k = rng.randrange(len(sets))
            question = rng.choice([items[k].question, *FOLLOW_UPS])
            slots[i] = _single(question, _shuffled(sets[k], rng))
    return [s for s in slots if s is not None]


def _fits(slots: list[LoadRequest | None], start: int, gap: int) -> bool:
    return all(slots[start + t * gap] is None for t in range(TURNS))


def _shuffled(passages: list[str], rng: random.Random) -> list[str]:
    """``passages`` in an order other than the stored one (where there is another)."""
    order = list(passages)
    for _ in range(8):
        rng.shuffle(order)
        if order != passages or len(set(passages)) < 2:
            break
    return order


def _single(question: str, passages: list[str]) -> LoadRequest:
    context = "\n\n".join(passages)
    messages = [
        {"role": "system", "content": system_prompt(context)},
        {"role": "user", "content": question},
    ]
    return LoadRequest(messages, "rag", passages)


def _chat(item: RagItem, passages: list[str], rng: random.Random) -> list[LoadRequest]:
    """A chat's turns: the whole conversation each time, as a chat client sends it."""
    first = _single(item.question, _shuffled(passages, rng))
    turns, messages = [first], list(first.messages)
    for follow_up in rng.sample(FOLLOW_UPS, TURNS - 1):
        messages += [
            {"role": "assistant", "content": _answer(item)},
            {"role": "user", "content": follow_up},
        ]
        turns.append(LoadRequest(list(messages), "chat", first.passages))
    return turns


def render(tokenizer: Any, request: LoadRequest) -> str:
    """The request's prompt as the server renders its messages (the chat template)."""
    return tokenizer.apply_chat_template(
        request.messages, add_generation_prompt=True, tokenize=False
    )


def write_dataset(
    path: Path, tokenizer: Any, requests: list[LoadRequest], output_tokens: int
) -> Path:
    """vLLM's ``custom`` dataset of ``requests`` (JSONL: ``prompt``, ``output_tokens``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for request in requests:
            line = {"prompt": render(tokenizer, request), "output_tokens": output_tokens}
            out.write(json.dumps(line) + "\n")
    return path
