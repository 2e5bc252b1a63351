"""Vector store searches recorded as recent chunks (langchain.hooks / langchain.vectorstores).

No model: a toy ``VectorStore`` subclass defined after the hooks are installed.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore, VectorStore

from kvrag_integrations.engine.prompting.spans import ChunkIndex
from kvrag_integrations.langchain import hooks
from kvrag_integrations.langchain.vectorstores import MARK, record_results, wrap_class

DOCS = [Document(page_content="Ada wrote the first algorithm."), Document(page_content="Bo ran.")]


@pytest.fixture()
def registry(monkeypatch: pytest.MonkeyPatch) -> ChunkIndex:
    """An empty process-wide registry for this test, with the hooks installed."""
    if not hooks.searches_recorded():
        pytest.skip(f"{hooks.RECORD_SEARCHES_ENV} turns search recording off")
    hooks.install_hooks()
    fresh = ChunkIndex()
    monkeypatch.setattr(hooks, "_RECENT", fresh)
    return fresh


def make_store() -> type[VectorStore]:
    """A VectorStore subclass defined now (after install_hooks)."""

    class ToyStore(VectorStore):
        def __init__(self, docs: list[Document]) -> None:
            self.docs = docs

        def add_texts(self, texts: Any, metadatas: Any = None, **kwargs: Any) -> list[str]:
            raise NotImplementedError

        @classmethod
        def from_texts(cls, texts: Any, embedding: Any, metadatas: Any = None, **kwargs: Any):
            return cls([Document(page_content=t) for t in texts])

        def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
            return self.docs[:k]

        def similarity_search_with_score(
            self, query: str, k: int = 4, **kwargs: Any
        ) -> list[tuple[Document, float]]:
            return [(d, 1.0 / (i + 1)) for i, d in enumerate(self.docs[:k])]

        async def asimilarity_search(self, query: str, k: int = 4, **kwargs: Any):
            await asyncio.sleep(0)
            return self.docs[:k]

        def similarity_search_lazily(self, query: str):  # a generator: left alone
            yield from self.docs

    return ToyStore


def test_a_store_defined_after_install_records_its_results(registry: ChunkIndex) -> None:
    store = make_store()(DOCS)
    result = store.similarity_search("q", k=1)
    assert result == DOCS[:1] and result[0] is DOCS[0]  # unchanged, same objects
    assert list(registry.find(DOCS[0].page_content + " " + DOCS[1].page_content)) == [
        DOCS[0].page_content
    ]


def test_scored_results_are_recorded_and_returned_unchanged(registry: ChunkIndex) -> None:
    store = make_store()(DOCS)
    result = store.similarity_search_with_score("q")
    assert result == [(DOCS[0], 1.0), (DOCS[1], 0.5)]
    assert all(d.page_content in registry for d in DOCS)


def test_async_methods_stay_async_and_record(registry: ChunkIndex) -> None:
    cls = make_store()
    assert inspect.iscoroutinefunction(cls.asimilarity_search)
    assert getattr(cls.asimilarity_search, MARK)
    assert asyncio.run(cls(DOCS).asimilarity_search("q")) == DOCS
    assert all(d.page_content in registry for d in DOCS)


def test_nothing_is_wrapped_twice(registry: ChunkIndex) -> None:
    cls = make_store()
    wrapped = cls.__dict__["similarity_search"]
    assert getattr(wrapped, MARK) and not getattr(wrapped.__wrapped__, MARK, False)
    assert wrapped.__name__ == "similarity_search"  # functools.wraps
    wrap_class(cls, hooks.record_text)
    hooks.install_hooks()

    class Sub(cls):  # inherits every method: nothing of its own to wrap
        pass

    assert cls.__dict__["similarity_search"] is wrapped
    assert "similarity_search" not in Sub.__dict__
    # a generator method is not wrapped (its results are read lazily)
    assert not getattr(cls.__dict__["similarity_search_lazily"], MARK, False)
    assert list(cls(DOCS).similarity_search_lazily("q")) == DOCS


def test_existing_stores_are_wrapped(registry: ChunkIndex) -> None:
    assert getattr(InMemoryVectorStore.__dict__["similarity_search"], MARK)
    assert getattr(InMemoryVectorStore.__dict__["amax_marginal_relevance_search"], MARK)


def test_subclass_hooks_chain(registry: ChunkIndex) -> None:
    """A store that defines its own __init_subclass__ (with keywords) still works."""
    seen: list[str] = []

    class Base(make_store()):
        def __init_subclass__(cls, tag: str = "", **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            seen.append(tag)

    class Tagged(Base, tag="t"):
        def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
            return [Document(page_content="Tagged text.")]

    assert seen == ["t"]
    assert Tagged(DOCS).similarity_search("q")[0].page_content in registry
    with pytest.raises(TypeError):

        class Bad(make_store(), unknown=1):  # object.__init_subclass__ still refuses it
            pass


def test_recording_never_raises_or_changes_results() -> None:
    def broken(text: str) -> None:
        raise RuntimeError("registry down")

    record_results(DOCS, broken)  # no exception
    seen: list[str] = []
    lazy = iter(DOCS)
    record_results(lazy, seen.append)  # an iterator is not consumed
    assert seen == [] and next(lazy) is DOCS[0]
    record_results([None, (), ("x", 1), (DOCS[1], [0.1])], seen.append)
    assert seen == [DOCS[1].page_content]


def test_the_environment_variable_turns_recording_off() -> None:
    code = textwrap.dedent(
        """
        from langchain_core.documents import Document
        from langchain_core.vectorstores import InMemoryVectorStore, VectorStore
        from kvrag_integrations.langchain.hooks import install_hooks, recent_chunks
        from kvrag_integrations.langchain.vectorstores import MARK

        install_hooks()
        assert not getattr(InMemoryVectorStore.similarity_search, MARK, False)

        class Toy(VectorStore):
            def add_texts(self, texts, metadatas=None, **kwargs):
                return []

            @classmethod
            def from_texts(cls, texts, embedding, metadatas=None, **kwargs):
                return cls()

            def similarity_search(self, query, k=4, **kwargs):
                return [Document(page_content="Not recorded.")]

        assert Toy().similarity_search("q")
        assert len(recent_chunks()) == 0
        print("off")
        """
    )
    env = {**os.environ, "KVRAG_LANGCHAIN_RECORD_SEARCHES": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=Path(__file__).resolve().parents[2],  # this checkout first on sys.path
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "off"
