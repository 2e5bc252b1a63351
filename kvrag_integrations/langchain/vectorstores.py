"""Documents any LangChain vector store's search returns become known chunks.

A plain ``vector_store.similarity_search(query)`` (the ``@dynamic_prompt``
middleware of LangChain's RAG agent, the ``retrieve`` node of its RAG tutorial)
runs no retriever, so no callback sees its documents. :func:`record_searches`
wraps, once, the search methods that ``VectorStore`` and each of its subclasses
define in their own class (``similarity_search*``, ``max_marginal_relevance_search*``,
``search`` and their ``a...`` async twins): of the classes that exist now, by
walking ``__subclasses__()``, and of those defined later, through
``VectorStore.__init_subclass__``. A wrapped method calls the original, hands
the ``page_content`` of each returned ``Document`` (or ``(Document, score)``
pair) to ``record`` and returns the result unchanged; recording never raises.
A method that calls another wrapped one records the same text twice, which
changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

from langchain_core.documents import Document
from langchain_core.vectorstores import VectorStore

# Marks a wrapper (and the __init_subclass__ hook), so nothing is wrapped twice.
MARK = "_kvrag_records_search"
SEARCH_METHOD = re.compile(r"a?(similarity_search|max_marginal_relevance_search)\w*|a?search")

Record = Callable[[str], None]


def record_results(result: Any, record: Record) -> None:
    """Hand each returned document's text to ``record``; never raises.

    Examples:
        >>> seen = []
        >>> record_results([Document(page_content="A."), (Document(page_content="B."), 0.9)],
        ...                seen.append)
        >>> seen
        ['A.', 'B.']
    """
    if not isinstance(result, (list, tuple)):  # an iterator would be consumed
        return
    with contextlib.suppress(Exception):  # recording must never break a search
        for item in result:
            if isinstance(item, tuple) and item:  # (Document, score) or (Document, vector)
                item = item[0]
            if isinstance(item, Document) and isinstance(item.page_content, str):
                record(item.page_content)


def recording(func: Callable[..., Any], record: Record) -> Callable[..., Any]:
    """``func`` wrapped to record its results (async stays async)."""
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def awrapper(*args: Any, **kwargs: Any) -> Any:
            result = await func(*args, **kwargs)
            record_results(result, record)
            return result

        wrapper: Callable[..., Any] = awrapper
    else:

        @functools.wraps(func)
        def swrapper(*args: Any, **kwargs: Any) -> Any:
            result = func(*args, **kwargs)
            record_results(result, record)
            return result

        wrapper = swrapper
    setattr(wrapper, MARK, True)
    return wrapper


def wrap_class(cls: type, record: Record) -> None:
    """Wrap the search methods ``cls`` defines itself (not inherited ones)."""
    for name, attr in list(vars(cls).items()):
        if not SEARCH_METHOD.fullmatch(name) or not inspect.isfunction(attr):
            continue  # properties, static and class methods are left alone
        if getattr(attr, MARK, False):
            continue
        if inspect.isgeneratorfunction(attr) or inspect.isasyncgenfunction(attr):
            continue  # results are consumed lazily: nothing to record without changing them
        with contextlib.suppress(Exception):  # a class that refuses it keeps its method
            setattr(cls, name, recording(attr, record))


def _subclasses(base: type) -> list[type]:
    seen: dict[type, None] = {}
    todo = [base]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen[cls] = None
            todo.extend(cls.__subclasses__())
    return list(seen)


def record_searches(record: Record) -> None:
    """Record the results of every ``VectorStore`` search, now and for later subclasses."""
    base = VectorStore
    previous = base.__dict__.get("__init_subclass__")
    if previous is not None and getattr(getattr(previous, "__func__", previous), MARK, False):
        return  # already installed

    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        if previous is not None:
            previous.__get__(None, cls)(**kwargs)  # chain the existing hook
        else:
            super(base, cls).__init_subclass__(**kwargs)
        with contextlib.suppress(Exception):  # never break a class definition
            wrap_class(cls, record)

    setattr(__init_subclass__, MARK, True)
    base.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment,method-assign]
    for cls in _subclasses(base):
        wrap_class(cls, record)
