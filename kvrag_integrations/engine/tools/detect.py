"""A family's streaming detector: how much of a growing answer is text whatever follows.

While an answer decodes, ``tool_answers`` asks after each token how much of it
may stream as text. ``ContentDetector`` answers from what it read before: the
family's leading form (``LeadScan``: a whole-answer call form, bare JSON or a
Python list) read on where it stopped, the markers searched for in the new text
only, trailing whitespace tracked as it comes. A stream of any length is read
in time linear in its length (re-reading the answer at each token made a 40 KB
argument take 20 s). ``ToolFamily.content_end`` is one fresh detector's answer
for a whole text, so the streamed text and the parse agree by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

MAYBE = "maybe"  # a leading form that may still become calls
CALLS = "calls"  # a leading form that is calls as it stands


class LeadScan:
    """A whole-answer call form read as the answer grows (a family's leading form).

    Subclasses read on from where they stopped (``_read``) and give the calls of
    an answer that is calls (``result``); once an answer cannot be calls, no
    longer one can either, and nothing more is read.
    """

    state: str | None = MAYBE

    def feed(self, text: str) -> str | None:
        """``CALLS`` where ``text`` is calls, ``MAYBE`` while it may still become
        calls, None where it cannot. ``text`` extends the last text fed."""
        if self.state is not None:
            self.state = self._read(text)
        return self.state

    def _read(self, text: str) -> str | None:
        raise NotImplementedError

    def result(self, text: str) -> tuple[list[dict[str, Any]], list[tuple[str | None, str, str]]]:
        """The calls and invalid calls of ``text``, which ``feed`` found ``CALLS``."""
        raise NotImplementedError


class ContentDetector:
    """How much of a growing answer is text whatever follows (one per stream).

    ``end`` takes the answer as it grows, each text extending the last (a shorter
    one, as when a stop string cuts it, starts the reading anew): nothing while
    the leading form may be calls; else up to the first marker, or to the end
    less what may begin a marker; trailing whitespace held (dropped before a call).
    """

    def __init__(self, markers: Sequence[str], lead: Callable[[], LeadScan | None]) -> None:
        self.markers = tuple(markers)
        self._make_lead = lead
        self._hold = max((len(m) - 1 for m in self.markers), default=0)
        self._start()

    def _start(self) -> None:
        self._lead = self._make_lead()
        self._fed = 0  # the length of the last text
        self._searched = 0  # the text searched for markers
        self._marker_at = -1
        self._ws_from = 0  # text[_ws_from:] not yet read for whitespace
        self._content = 0  # the end of text[:_ws_from] less its trailing whitespace

    def end(self, text: str) -> int:
        """How much of ``text`` is content whatever follows."""
        if len(text) < self._fed:
            self._start()
        self._fed = len(text)
        if self._lead is not None:
            if self._lead.feed(text) is not None:
                return 0
            self._lead = None  # cannot be calls: no longer text can be either
        return self._rstripped(text, self._marker(text))

    def _marker(self, text: str) -> int:
        """Where the first marker starts; else the end less what may begin one."""
        if self._marker_at < 0 and self.markers:
            start = max(0, self._searched - self._hold)
            hits = [at for at in (text.find(m, start) for m in self.markers) if at >= 0]
            self._marker_at = min(hits, default=-1)
            self._searched = len(text)
        if self._marker_at >= 0:
            return self._marker_at
        return len(text) - partial_marker(text, self.markers)

    def _rstripped(self, text: str, at: int) -> int:
        """``len(text[:at].rstrip())``, reading only what came since the last call."""
        if at < self._ws_from:  # not met in a stream (the end only moves on)
            return len(text[:at].rstrip())
        kept = text[self._ws_from : at].rstrip()
        if kept:
            self._content = self._ws_from + len(kept)
        self._ws_from = at
        return self._content


def partial_marker(text: str, markers: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins a marker."""
    for k in range(min(len(text), max((len(m) - 1 for m in markers), default=0)), 0, -1):
        if any(m.startswith(text[-k:]) for m in markers):
            return k
    return 0
