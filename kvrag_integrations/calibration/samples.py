"""The prompts a calibration measures on: the user's own chunks, in RAG prompts.

Chunks come from the store (the texts of this model's entries, decoded from
their token ids) or from a file (a JSON list of strings, MuSiQue-style items
with ``ctxs``, JSON lines, or plain text split at blank lines). Each prompt
puts ``chunks_per_prompt`` of them in a new order before a question. Where the
user gives no questions, each prompt asks about a name or phrase taken from
one of its chunks (a retrieval question's shape: the answer is in one chunk,
the others are distractors). A file of RAG items (``question`` and ``ctxs``,
MuSiQue's form: an evaluation set) gives its prompts as they are
(``prompts_from_items``).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrag_integrations.errors import CalibrationError

# A capitalised word, then more joined by spaces or "of", "the", "de" ("Bank of America").
_NAME = re.compile(r"\b[A-Z][\w'-]+(?:\s+(?:(?:of|the|de)\s+)*[A-Z][\w'-]+)*")
_WORDS = re.compile(r"[A-Za-z][\w'-]+")


@dataclass(frozen=True)
class SamplePrompt:
    """One calibration prompt: a question over chunks, in prompt order."""

    question: str
    chunks: tuple[str, ...]


def chunks_from_file(path: str | Path) -> list[str]:
    """Chunk texts from a file (see the module docstring).

    Raises:
        CalibrationError: the file holds no chunk text.
    """
    text = Path(path).read_text(encoding="utf-8")
    chunks: list[str] = []
    try:
        data: Any = json.loads(text)
    except ValueError:
        data = None
        lines = [line for line in text.splitlines() if line.strip()]
        try:
            data = [json.loads(line) for line in lines]
        except ValueError:
            chunks = [part.strip() for part in re.split(r"\n\s*\n", text) if part.strip()]
    if data is not None:
        chunks = list(_texts(data))
    chunks = list(dict.fromkeys(c for c in chunks if c.strip()))
    if not chunks:
        raise CalibrationError(f"no chunk text in {path}")
    return chunks


def _texts(data: Any) -> list[str]:
    """Strings, ``{"text": ...}`` objects and MuSiQue items' ``ctxs``, in order."""
    out: list[str] = []
    items = data if isinstance(data, list) else [data]
    for item in items:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and isinstance(item.get("ctxs"), list):
            out += [c["text"] for c in item["ctxs"] if isinstance(c, dict) and "text" in c]
        elif isinstance(item, dict) and isinstance(item.get("text"), str):
            out.append(item["text"])
    return out


def question_about(chunk: str, rng: random.Random) -> str:
    """A retrieval question about a name (else a phrase) in ``chunk``.

    Examples:
        >>> question_about("The Eiffel Tower was completed in 1889.", random.Random(0))
        'What do the passages say about The Eiffel Tower?'
    """
    names = [m.group(0).strip() for m in _NAME.finditer(chunk) if len(m.group(0).split()) >= 2]
    if not names:
        names = [m.group(0) for m in _NAME.finditer(chunk)]
    if names:
        subject = rng.choice(names)
    else:
        words = _WORDS.findall(chunk)
        start = rng.randrange(max(1, len(words) - 3)) if words else 0
        subject = " ".join(words[start : start + 3]) or chunk[:40]
    return f"What do the passages say about {subject}?"


def sample_prompts(
    chunks: Sequence[str],
    *,
    prompts: int = 8,
    chunks_per_prompt: int = 10,
    questions: Sequence[str] = (),
    seed: int = 0,
) -> list[SamplePrompt]:
    """``prompts`` RAG prompts of ``chunks_per_prompt`` chunks each, drawn from
    ``chunks`` (each prompt's in a new order); ``questions`` are used in turn where
    given, else each prompt asks about one of its chunks.

    Raises:
        CalibrationError: fewer than two chunks.
    """
    pool = list(dict.fromkeys(c for c in chunks if c.strip()))
    if len(pool) < 2:
        raise CalibrationError("a calibration needs at least two distinct chunks")
    rng = random.Random(seed)
    per = max(1, min(chunks_per_prompt, len(pool)))
    out = []
    for i in range(prompts):
        picked = rng.sample(pool, per)
        question = (
            questions[i % len(questions)] if questions else question_about(rng.choice(picked), rng)
        )
        out.append(SamplePrompt(question, tuple(picked)))
    return out


def chunks_from_store(engine: Any, limit: int = 256, seed: int = 0) -> list[str]:
    """Texts of up to ``limit`` of the chunks whose entries ``engine`` stored (this
    model's, in its encoding context), decoded from their token ids.

    Raises:
        CalibrationError: the store holds none of this model's entries.
    """
    fingerprint = engine.fingerprint
    keys = [info.key for info in engine.store.entries() if info.fingerprint == fingerprint]
    random.Random(seed).shuffle(keys)
    suffix = engine.prompts.suffix_ids.tolist()
    texts = []
    for key in keys[:limit]:
        kv = engine.store.get(key, fingerprint)
        if kv is None:
            continue
        ids = kv.token_ids.tolist()
        if suffix and ids[-len(suffix) :] == suffix:
            ids = ids[: -len(suffix)]
        text = engine.tokenizer.decode(ids).strip()
        if text:
            texts.append(text)
    if len(texts) < 2:
        raise CalibrationError(
            "the store holds fewer than two of this model's chunk entries: ingest "
            "your chunks first, or pass them as a file (--chunks)"
        )
    return texts


def prompts_from_items(
    path: str | Path, first: int = 0, last: int | None = None, chunks_per_prompt: int = 10
) -> list[SamplePrompt]:
    """RAG items (``{"question", "ctxs": [{"text"}]}``, MuSiQue's form) ``first ..
    last`` of a JSON file as prompts: each question over its own first
    ``chunks_per_prompt`` passages.

    Raises:
        CalibrationError: the file holds no such item in that range.
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    items = data[first:last] if isinstance(data, list) else []
    prompts = []
    for item in items:
        ctxs = item.get("ctxs") if isinstance(item, dict) else None
        question = item.get("question") if isinstance(item, dict) else None
        if isinstance(question, str) and isinstance(ctxs, list):
            texts = [
                c["text"] for c in ctxs if isinstance(c, dict) and isinstance(c.get("text"), str)
            ]
            texts = [t for t in texts if t.strip()][:chunks_per_prompt]
            if texts:
                prompts.append(SamplePrompt(question, tuple(texts)))
    if not prompts:
        raise CalibrationError(f"no RAG items (question and ctxs) in {path}[{first}:{last}]")
    return prompts


def trimmed(engine: Any, prompt: SamplePrompt, tokens: int) -> SamplePrompt:
    """``prompt`` with each chunk cut to about ``tokens`` tokens (empty ones dropped)."""
    from kvrag_integrations.bench.common import trim_to_tokens

    chunks = (trim_to_tokens(engine.tokenizer, c, tokens) for c in prompt.chunks)
    return SamplePrompt(prompt.question, tuple(c for c in chunks if c.strip()))
