"""Training items from a corpus, and the deterministic held-out split.

Two corpus forms:

- a JSON file: MuSiQue-style items ``{"question", "answers", "ctxs": [{"text"}]}``
  (``../shared/data/musique_dev.json``), or ``{"question", "chunks"|"passages",
  "answers"|"answer"}`` items;
- a folder of ``.txt`` / ``.md`` passages (one passage per file) with a
  ``questions.json`` list whose entries are a question string or
  ``{"question", "answer"?, "passages"?: [file names]}``; without ``passages``
  a question is asked over every passage.

No labels are needed: the trainer distils the base model's own answers. An
item's id is a hash of its question and passages, and whether it is held out
depends only on that id, so evaluation never sees a training item whatever the
order, count or seed.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PASSAGE_SUFFIXES = (".txt", ".md", ".markdown")


@dataclass(frozen=True)
class RagExample:
    """One question over its passages (the chunks of a prompt).

    Attributes:
        question: the user's question.
        passages: candidate chunk texts, in order.
        answers: gold answers, possibly empty.
    """

    question: str
    passages: tuple[str, ...]
    answers: tuple[str, ...] = field(default_factory=tuple)

    @property
    def item_id(self) -> str:
        """A stable id: sha256 of the question and passages (16 hex digits).

        Examples:
            >>> RagExample("Who?", ("A.",)).item_id == RagExample("Who?", ("A.",)).item_id
            True
        """
        digest = hashlib.sha256(self.question.encode())
        for text in self.passages:
            digest.update(b"\x00" + text.encode())
        return digest.hexdigest()[:16]


def is_heldout(item_id: str, fraction: float) -> bool:
    """Whether an item is kept out of training: a fixed function of its id.

    Examples:
        >>> is_heldout("00000000aaaa", 0.2), is_heldout("ffffffffaaaa", 0.2)
        (True, False)
    """
    return int(item_id[:8], 16) / 0x100000000 < fraction


def split(
    examples: list[RagExample], heldout_fraction: float = 0.2
) -> tuple[list[RagExample], list[RagExample]]:
    """``(train, heldout)`` by ``is_heldout`` of each item's id (input order kept)."""
    train = [e for e in examples if not is_heldout(e.item_id, heldout_fraction)]
    held = [e for e in examples if is_heldout(e.item_id, heldout_fraction)]
    return train, held


def load_corpus(path: str | os.PathLike) -> list[RagExample]:
    """Read a corpus (JSON file or folder of passages, see the module docstring).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the corpus has no usable question.
    """
    source = Path(path)
    if source.is_dir():
        examples = _load_folder(source)
    elif source.is_file():
        examples = [_json_item(r) for r in json.loads(source.read_text(encoding="utf-8"))]
    else:
        raise FileNotFoundError(f"corpus not found: {source}")
    examples = [e for e in examples if e.question.strip() and e.passages]
    if not examples:
        raise ValueError(f"no question with passages in {source}")
    return examples


def _json_item(raw: dict[str, Any]) -> RagExample:
    if "ctxs" in raw:
        passages = [c["text"] for c in raw["ctxs"]]
    else:
        passages = list(raw.get("chunks") or raw.get("passages") or [])
    answers = raw.get("answers")
    if answers is None:
        answers = [raw["answer"]] if raw.get("answer") else []
    texts = tuple(p for p in passages if isinstance(p, str) and p.strip())
    return RagExample(str(raw["question"]), texts, tuple(str(a) for a in answers))


def _load_folder(folder: Path) -> list[RagExample]:
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in PASSAGE_SUFFIXES)
    passages = {p.name: p.read_text(encoding="utf-8").strip() for p in files}
    passages = {name: text for name, text in passages.items() if text}
    qfile = folder / "questions.json"
    if not qfile.is_file():
        raise FileNotFoundError(f"{folder} has no questions.json")
    examples = []
    for raw in json.loads(qfile.read_text(encoding="utf-8")):
        entry = {"question": raw} if isinstance(raw, str) else dict(raw)
        names = entry.get("passages") or list(passages)
        missing = [n for n in names if n not in passages]
        if missing:
            raise ValueError(f"questions.json names unknown passages: {missing}")
        answer = entry.get("answer")
        examples.append(
            RagExample(
                str(entry["question"]),
                tuple(passages[n] for n in names),
                (str(answer),) if answer else (),
            )
        )
    return examples


def trim_to_tokens(tokenizer: Any, text: str, n_tokens: int) -> str:
    """``text`` cut to about ``n_tokens`` tokens (at a token boundary)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:n_tokens]
    return tokenizer.decode(ids).strip()


def prompt_chunks(
    tokenizer: Any, example: RagExample, n_chunks: int, chunk_tokens: int, variant: int = 0
) -> list[str]:
    """The chunks of one prompt: ``n_chunks`` passages trimmed to ``chunk_tokens``.

    ``variant`` rotates which passages are used (a different prompt per epoch over
    the same item); variant 0 takes the first ones, as the evaluation does.
    """
    passages = list(example.passages)
    start = (variant * n_chunks) % len(passages)
    chosen = (passages[start:] + passages[:start])[:n_chunks]
    out = [trim_to_tokens(tokenizer, p, chunk_tokens) if chunk_tokens else p for p in chosen]
    return [c for c in out if c.strip()]
