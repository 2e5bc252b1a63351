"""How many vLLMs a test run starts: each one declared, each one seen, and a limit.

A vLLM start (an engine in the test process, an OpenAI server, one in a docs
example or a notebook) costs CI half a minute to a minute, so the run counts
them. The fixtures of ``tests/integration/with_vllm/conftest.py`` declare each
start they make; a test that starts vLLM itself (in a subprocess: a docs page's
examples) declares its starts with ``@pytest.mark.starts_vllm(n)``. Every vLLM
runs its engine core in a process of its own, titled ``VLLM::EngineCore``: a
watcher counts those among the test process's descendants. The run fails when
it saw more than were declared (a start that no fixture or marker names) or
when more were declared than ``MAX_STARTS``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

# The vLLM lane's starts (``python -m pytest tests/integration/with_vllm``): the
# session engine, the two replicas, the two shared servers (README flags; tool
# calling), the attacked server, the flooded one, the one with two API processes,
# four tiny families and the three engines of docs/vllm.md's examples. Raise it
# only for a test that cannot share.
MAX_STARTS = 15
# vLLM's engine core sets its process title; the kernel keeps 15 bytes of it.
ENGINE_CORE_TITLE = "VLLM::EngineCore"[:15]
_PROC = Path("/proc")


def _stat(pid: str) -> tuple[str, int, str] | None:
    """(title, parent pid, start time) of ``pid`` from /proc; None once it is gone."""
    try:
        text = (_PROC / pid / "stat").read_text()
    except OSError:
        return None
    title, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
    fields = rest.split()
    return title, int(fields[1]), fields[19]  # state, ppid, ..., starttime (field 22)


@dataclass
class VLLMStarts:
    """The run's ledger of vLLM starts and the engine cores seen (``scan``)."""

    root: int = field(default_factory=os.getpid)
    declared: list[tuple[str, int]] = field(default_factory=list)
    seen: set[tuple[int, str]] = field(default_factory=set)
    confirmed: int = 0  # starts whose engine core a scan found up

    @property
    def watching(self) -> bool:
        return _PROC.joinpath("self", "stat").is_file()

    def declare(self, who: str, count: int = 1) -> None:
        self.declared.append((who, count))

    def total(self) -> int:
        return sum(count for _, count in self.declared)

    def scan(self) -> int:
        """Record the engine cores now running under this process; how many there are."""
        if not self.watching:
            return 0
        table = {pid: s for pid in os.listdir(_PROC) if pid.isdigit() and (s := _stat(pid))}
        found = 0
        for pid, (title, parent, started) in table.items():
            if title != ENGINE_CORE_TITLE:
                continue
            for _ in range(64):  # up the parents to this process (or to init)
                if parent == self.root:
                    self.seen.add((int(pid), started))
                    found += 1
                    break
                up = table.get(str(parent))
                if up is None:
                    break
                parent = up[1]
        return found

    def confirm(self) -> None:
        """After a declared start is up: its engine core must be visible now."""
        if self.scan():
            self.confirmed += 1

    def problems(self) -> list[str]:
        """Why the run fails on its starts (none: it passes)."""
        out = []
        if len(self.seen) > self.total():
            out.append(
                f"{len(self.seen)} vLLM engine cores ran under this test process, "
                f"{self.total()} starts were declared: a test starts vLLM without the "
                "fixtures of tests/integration/with_vllm/conftest.py or a starts_vllm marker"
            )
        if self.total() > MAX_STARTS:
            out.append(
                f"{self.total()} vLLM starts declared, more than MAX_STARTS = {MAX_STARTS} "
                "(tests/integration/vllm_starts.py): share the session's engine or servers"
            )
        if self.confirmed and not self.seen:
            out.append(f"no {ENGINE_CORE_TITLE!r} process was ever seen: the watcher is blind")
        return out

    def summary(self) -> str:
        who = ", ".join(f"{w} {n}" if n != 1 else w for w, n in self.declared)
        return (
            f"vLLM starts: {self.total()} declared (limit {MAX_STARTS}), "
            f"{len(self.seen)} engine cores seen: {who or 'none'}"
        )


class Watcher:
    """Scans for engine cores every ``interval`` seconds while the run lasts (a start
    takes several seconds: none is missed)."""

    def __init__(self, starts: VLLMStarts, interval: float = 0.5) -> None:
        self.starts, self.interval = starts, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-starts", daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.starts.scan()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.starts.scan()
