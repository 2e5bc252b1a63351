"""Test passages and questions both tiers use (imported as ``corpus``: tests/ is on
the import path, as for ``langchain_suites``), and the disk-backed engine the
prefetch tests build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrag_integrations import DiskKVStore, KVRAGEngine

TOWER = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. "
    "It was designed by the company of the engineer Gustave Eiffel and completed in 1889."
)
REEF = (
    "The Great Barrier Reef, off the coast of Queensland in Australia, is the world's "
    "largest coral reef system, made of almost 3,000 individual reefs."
)
TOWER_QUESTION = "In which year was the Eiffel Tower completed?"

CAPITALS = [
    "Canberra is the capital city of Australia; Parliament first met there in 1927.",
    "Ottawa is the capital of Canada. It lies on the Ottawa River in Ontario.",
    "Wellington is the capital of New Zealand, at the southern tip of the North Island.",
]
CAPITAL_QUESTION = "What is the capital of Canada?"


# LangChain's documented LCEL RAG: its prompt, its format_docs, a few documents.
LCEL_DOCS = [
    "The Rosetta Stone was found in 1799 by French soldiers near Rashid, in the Nile "
    "delta. It carries one decree in hieroglyphic, Demotic and ancient Greek.",
    "Jean-Francois Champollion announced the decipherment of the hieroglyphs in 1822, "
    "working from the Greek text of the Rosetta Stone and from Coptic.",
    "The Great Pyramid of Giza was the tallest man-made structure for nearly four "
    "thousand years, until Lincoln Cathedral was finished in 1311.",
]
LCEL_QUESTION = "Who deciphered the hieroglyphs?"
LCEL_TEMPLATE = """Answer the question based only on the following context:
{context}

Question: {question}
"""


def format_docs(docs: list[Any]) -> str:
    """LangChain's documented helper: the documents' texts, a blank line apart."""
    return "\n\n".join(doc.page_content for doc in docs)


def on_disk(engine: KVRAGEngine, root: Path) -> KVRAGEngine:
    """An engine over ``engine``'s weights with a disk store (reads that prefetch can start)."""
    return KVRAGEngine(engine.loaded, store=DiskKVStore(root), on_miss="encode")


# An OpenAI function tool, the neutral form every engine takes as ``tools``.
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the documents.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}
