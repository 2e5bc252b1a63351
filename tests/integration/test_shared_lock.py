"""Two engines on one LoadedModel: one forward lock, so their forwards never overlap."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from kvrag_integrations import KVRAGEngine, MemoryKVStore

CHUNKS = [
    "The Amazon River flows through Brazil, Peru and Colombia into the Atlantic Ocean.",
    "Lake Baikal in Siberia is the deepest lake in the world.",
]


class OverlapRecorder:
    """Counts forwards of the model running at the same time (the most seen at once)."""

    def __init__(self, model) -> None:
        self.model, self.running, self.most, self.calls = model, 0, 0, 0
        self._guard = threading.Lock()

    def __enter__(self) -> OverlapRecorder:
        self.hooks = [
            self.model.register_forward_pre_hook(self._enter),
            self.model.register_forward_hook(self._exit),
        ]
        return self

    def _enter(self, *_: object) -> None:
        with self._guard:
            self.running += 1
            self.calls += 1
            self.most = max(self.most, self.running)

    def _exit(self, *_: object) -> None:
        with self._guard:
            self.running -= 1

    def __exit__(self, *exc: object) -> None:
        for hook in self.hooks:
            hook.remove()


def test_requests_on_two_engines_over_one_model_serialize(engine: KVRAGEngine) -> None:
    a = KVRAGEngine(engine.loaded, store=MemoryKVStore(), on_miss="encode")
    b = KVRAGEngine(engine.loaded, store=MemoryKVStore(), on_miss="encode")
    assert a.exclusive() is b.exclusive() is engine.loaded.lock
    jobs = []
    for i in range(8):
        e = (a, b)[i % 2]
        question = "Which ocean?" if i % 4 < 2 else "Deepest lake?"
        jobs.append((e, question, [CHUNKS[i % 2]], ("turbo", "full")[i // 4]))

    def run(job):
        e, question, chunks, strategy = job
        if strategy == "turbo" and job is jobs[0]:  # a stream too: decoded on its worker
            return "".join(e.stream(question=question, chunks=chunks, max_new_tokens=6))
        return e.generate(
            question=question, chunks=chunks, strategy=strategy, max_new_tokens=6
        ).text

    with OverlapRecorder(engine.model) as seen, ThreadPoolExecutor(max_workers=8) as pool:
        texts = list(pool.map(run, jobs))
    assert seen.calls > len(jobs)  # prefills, chunk encodings and decode steps
    assert seen.most == 1, f"{seen.most} forwards ran at once on one model"
    assert all(isinstance(t, str) for t in texts)
