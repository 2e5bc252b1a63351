"""Judging prompts for the decoder reranker, laid out document first.

HyperRAG (arXiv 2504.02921) puts the document *before* the query so that the
instruction and the document form a true prefix of every prompt that judges this
document: its KV cache can be computed once and reused for any query. A template
is therefore three texts around two slots::

    [prefix][document][middle][query][suffix]

With ``chat=True`` the pieces form the user message of the model's own chat
template (plus an optional system message and the assistant generation prompt),
rendered around the two slots by the engine's ``chat_template.render_slots``, so
the text before the document is exactly what the model would see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvrag_integrations.engine.prompting.chat_template import SLOT, SlottedMessage, render_slots
from kvrag_integrations.engine.prompting.segments import Text
from kvrag_integrations.engine.prompting.tokenize import tokenize_text, tokenize_texts
from kvrag_integrations.errors import UnsupportedModelError

# The answer words whose probabilities are compared; every casing that is one
# token is counted (logsumexp), so the score does not hinge on the model's habit
# of answering "Yes", " yes" or "YES".
YES_VARIANTS = ("yes", " yes", "Yes", " Yes", "YES", " YES")
NO_VARIANTS = ("no", " no", "No", " No", "NO", " NO")


@dataclass(frozen=True)
class RenderedTemplate:
    """The three literal texts around the document and query slots.

    Attributes:
        before_document: everything before the document (system turn, instruction).
        before_query: everything between the document and the query.
        after_query: everything after the query, ending where the model answers.
    """

    before_document: str
    before_query: str
    after_query: str


@dataclass(frozen=True)
class RerankTemplate:
    """A judging prompt: ``[prefix][document][middle][query][suffix]``.

    Attributes:
        name: the template's name; it also names the prefix caches' key space, so
            change it when you change the wording.
        prefix: text before the document.
        middle: text after the document and before the query.
        suffix: text after the query, including the Yes/No question.
        chat: wrap ``prefix..suffix`` as the user message of the tokenizer's chat
            template (with ``system`` as system message and the assistant
            generation prompt at the end). Without a chat template on the
            tokenizer, the plain text is used.
        system: the system message for ``chat=True`` (None: the template's default).

    Examples:
        >>> t = RerankTemplate("plain", "Doc: ", " Query: ", " Relevant (Yes/No)?")
        >>> t.render(None).before_query
        ' Query: '
    """

    name: str
    prefix: str
    middle: str
    suffix: str
    chat: bool = False
    system: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a RerankTemplate needs a non-empty name")
        for field in ("prefix", "middle", "suffix"):
            if not isinstance(getattr(self, field), str):
                raise TypeError(f"RerankTemplate.{field} must be a str")

    def render(self, tokenizer: Any) -> RenderedTemplate:
        """Render the template for ``tokenizer`` and split it around the two slots.

        Args:
            tokenizer: a Hugging Face tokenizer (only used when ``chat`` is true).

        Raises:
            ValueError: the chat template reordered or dropped a slot.
        """
        if not self.chat or not getattr(tokenizer, "chat_template", None):
            lead = f"{self.system}\n\n" if self.chat and self.system else ""
            return RenderedTemplate(lead + self.prefix, self.middle, self.suffix)
        messages: list[SlottedMessage] = []
        if self.system is not None:
            messages.append(("system", [self.system]))
        messages.append(("user", [self.prefix, SLOT, self.middle, SLOT, self.suffix]))
        try:
            head, middle, tail = render_slots(tokenizer, messages)
        except ValueError as exc:
            raise ValueError(
                f"the chat template dropped or reordered the slots of template {self.name!r}"
            ) from exc
        return RenderedTemplate(head, middle, tail)


# The default, for instruct chat models. The wording was checked on
# SmolLM2-135M-Instruct (tests/integration/test_rerank.py ranks a verbatim answer first).
# "Document:" ends with a newline, not a space, so that the document's first
# word keeps the token it has in running text (byte-level BPE glues a leading
# space to the next word).
DEFAULT_TEMPLATE = RerankTemplate(
    name="chat-yes-no-v1",
    system=(
        "You judge whether a document is relevant to a query. "
        'Answer only "Yes" if the document answers the query, otherwise "No".'
    ),
    prefix="Document:\n",
    middle="\n\nQuery:\n",
    suffix="\n\nDoes the document answer the query? Answer Yes or No.",
    chat=True,
)

# Qwen3-Reranker's prompt (written out in ChatML, as its model card does), with
# the document moved in front of the instruction and query.
QWEN3_RERANKER_TEMPLATE = RerankTemplate(
    name="qwen3-reranker-v1",
    prefix=(
        "<|im_start|>system\nJudge whether the Document meets the requirements based on "
        "the Query and the Instruct provided. Note that the answer can only be "
        '"yes" or "no".<|im_end|>\n<|im_start|>user\n<Document>: '
    ),
    middle=(
        "\n<Instruct>: Given a web search query, retrieve relevant passages that answer "
        "the query\n<Query>: "
    ),
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
)

# BAAI bge-reranker-v2-gemma's plain prompt (passage A is already first there).
BGE_GEMMA_TEMPLATE = RerankTemplate(
    name="bge-gemma-v1",
    prefix="A: ",
    middle="\nB: ",
    suffix=(
        "\nPredict whether passage A contains an answer to query B by providing a "
        "prediction of either 'Yes' or 'No'.\n"
    ),
)

# Query likelihood (UPR, arXiv 2204.07496): the score is the mean log-probability
# of the query's tokens written after the document, so the query is the last slot
# and nothing follows it. Plain text: the query continues the prompt directly.
UPR_TEMPLATE = RerankTemplate(
    name="upr-v1",
    prefix="Passage:\n",
    middle="\n\nPlease write a question based on this passage.\nQuestion:",
    suffix="",
)

TEMPLATES: dict[str, RerankTemplate] = {
    "default": DEFAULT_TEMPLATE,
    "qwen3-reranker": QWEN3_RERANKER_TEMPLATE,
    "bge-gemma": BGE_GEMMA_TEMPLATE,
    "upr": UPR_TEMPLATE,
}


def get_template(template: str | RerankTemplate | None) -> RerankTemplate:
    """Return a preset by name (``"default"``, ``"qwen3-reranker"``, ``"bge-gemma"``).

    Examples:
        >>> get_template("bge-gemma").name
        'bge-gemma-v1'
    """
    if template is None:
        return DEFAULT_TEMPLATE
    if isinstance(template, RerankTemplate):
        return template
    try:
        return TEMPLATES[template]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown rerank template {template!r}; use one of {sorted(TEMPLATES)} "
            "or a RerankTemplate"
        ) from None


def answer_token_ids(tokenizer: Any, variants: Sequence[str]) -> list[int]:
    """The ids of the ``variants`` that are a single token, deduplicated.

    Examples:
        >>> class Tok:
        ...     def __call__(self, text, add_special_tokens=False):
        ...         return {"input_ids": [len(text)] if text.strip() == text else [0, 1]}
        >>> answer_token_ids(Tok(), ["yes", " yes", "Yes"])
        [3]
    """
    ids: list[int] = []
    for word in variants:
        tok = tokenizer(word, add_special_tokens=False)["input_ids"]
        if len(tok) == 1 and tok[0] not in ids:
            ids.append(int(tok[0]))
    return ids


class TokenizedTemplate:
    """A template bound to a tokenizer: prompt ids built segment by segment.

    The prefix ids are the instruction's ids (markup: its control tokens are
    real) then the document's (literal text), each tokenized alone, so a
    document's prefix (and its cache key) never depends on the query; the suffix
    (text after the document, the literal query, the question) is tokenized as
    one run since it is never cached.

    Examples:
        >>> tok = lambda text, add_special_tokens=False: {"input_ids": [len(text)]}
        >>> p = TokenizedTemplate(get_template("bge-gemma"), tok)
        >>> p.prefix_ids("Canberra").tolist()  # "A:" then " Canberra"
        [2, 9]
    """

    def __init__(self, template: RerankTemplate, tokenizer: Any) -> None:
        self.template = template
        self.tokenizer = tokenizer
        parts = template.render(tokenizer)
        # A trailing space before the document is handed to the document's own
        # text: byte-level BPE tokenizers glue a space to the next word, so this
        # keeps the document's first token what it is in running text.
        self.doc_lead = " " if parts.before_document.endswith(" ") else ""
        head = parts.before_document[: len(parts.before_document) - len(self.doc_lead)]
        self.head_ids = tokenize_text(tokenizer, head, markup=True)
        self.before_query = parts.before_query
        self.after_query = parts.after_query
        self.yes_ids = answer_token_ids(tokenizer, YES_VARIANTS)
        self.no_ids = answer_token_ids(tokenizer, NO_VARIANTS)
        if not self.yes_ids or not self.no_ids:
            raise UnsupportedModelError("the tokenizer has no single-token 'yes' and 'no'")

    def prefix_ids(self, document: str) -> torch.Tensor:
        """Ids of ``[instruction][document]``: the cached, reusable part."""
        doc = tokenize_text(self.tokenizer, self.doc_lead + document)
        return torch.cat([self.head_ids, doc])

    def suffix_ids(self, query: str) -> torch.Tensor:
        """Ids of everything after the document, ending where the model answers.

        The template's text is markup; the query, like the document, is literal.
        """
        texts = [
            Text(self.before_query, markup=True),
            Text(query),
            Text(self.after_query, markup=True),
        ]
        return tokenize_texts(self.tokenizer, texts)

    def query_ids(self, query: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(text after the document, the query)`` ids, for query-likelihood scoring.

        The query is tokenized alone (after a space, as in running text), so its
        tokens are exactly the ones whose log-probabilities are summed; the
        template's text is markup, the query literal.
        """
        lead = tokenize_text(self.tokenizer, self.before_query, markup=True)
        return lead, tokenize_text(self.tokenizer, " " + query.strip())
