"""EncodeLedger: the one ledger of background encodings both engines keep.

Deduplicated by key, bounded (over ``max_pending`` queued, a skipped enqueue,
never an error), waited for with a timeout, cancelled. ``BackgroundEncoder``
(KVRAGEngine) keeps its queue and flights on one (tests/unit/test_second_request.py
pins that behaviour); ``VLLMEngine`` its encode requests, checked here with a
stand-in vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from kvrag_integrations.engine.scheduling.background import BackgroundEncoder
from kvrag_integrations.engine.scheduling.ledger import EncodeLedger
from kvrag_integrations.vllm.client.backend import BackendEvent, BackendRequest
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine


def test_one_encoding_per_key_and_it_leaves_when_done() -> None:
    ledger: EncodeLedger[str] = EncodeLedger()
    first = Future()
    assert ledger.add("a", first)
    assert not ledger.add("a", Future())  # queued already
    assert ledger.get("a") is first and ledger.queued() == ["a"] and len(ledger) == 1
    first.set_running_or_notify_cancel()
    assert ledger.queued() == [] and ledger.pending(["a", "b"]) == {"a": first}
    first.set_result(1)
    assert len(ledger) == 0 and ledger.get("a") is None
    assert ledger.add("a", Future())  # ended: it may be encoded again


def test_over_max_pending_queued_an_enqueue_is_skipped_not_an_error() -> None:
    ledger: EncodeLedger[int] = EncodeLedger(max_pending=2)
    started = []
    for key in range(4):
        ledger.submit(key, lambda key=key: started.append(key) or Future())
    assert started == [0, 1] and ledger.dropped == 2
    running = Future()
    running.set_running_or_notify_cancel()
    assert ledger.add(9, running)  # started already: not queued, not capped
    with pytest.raises(ValueError, match="max_pending"):
        EncodeLedger(max_pending=0)


def test_wait_times_out_then_ends_and_cancel_drops_the_queued() -> None:
    ledger: EncodeLedger[str] = EncodeLedger()
    queued, running = Future(), Future()
    running.set_running_or_notify_cancel()
    ledger.add("queued", queued)
    ledger.add("running", running)
    assert not ledger.wait(timeout=0.01)
    assert not ledger.wait(["running"], timeout=0.01)
    assert ledger.cancel() == 1 and queued.cancelled()  # in flight: runs on
    threading.Timer(0.05, running.set_result, (None,)).start()
    assert ledger.wait(["running"], timeout=5) and ledger.wait(timeout=5)
    assert ledger.close() == 0 and not ledger.add("late", Future())


def test_a_failed_encoding_is_logged_and_leaves(caplog: pytest.LogCaptureFixture) -> None:
    ledger: EncodeLedger[str] = EncodeLedger()
    with ThreadPoolExecutor(1) as pool:
        ledger.submit("a", lambda: pool.submit(_raise))
        assert ledger.wait(timeout=5)
    assert "background chunk encoding failed: no reply" in caplog.text


def _raise() -> None:
    raise RuntimeError("no reply")


def test_background_encoder_keeps_its_queue_on_a_ledger() -> None:
    encoded = []
    encoder = BackgroundEncoder(lambda jobs: encoded.extend(jobs), max_pending=1)
    assert isinstance(encoder.ledger, EncodeLedger) and encoder.max_pending == 1
    accepted = encoder.submit({"a": (None, None), "b": (None, None)})
    assert len(accepted) == 1 and encoder.dropped == 1
    assert encoder.wait(timeout=5) and len(encoded) == 1 and encoder.pending == 0
    encoder.close()


class _SlowBackend:
    """A vLLM stand-in whose encode requests wait for ``release``."""

    model_name = "tiny"
    context_window = 2048

    def __init__(self) -> None:
        self.release = threading.Event()
        self.seen: list[list[int]] = []

    def submit(self, request: BackendRequest, cancel: threading.Event) -> Iterator[BackendEvent]:
        self.seen.append(request.prompt_ids)
        self.release.wait(10)
        yield BackendEvent(finish_reason="length")  # no connector reply: the encode fails

    def close(self) -> None:
        pass


def test_vllm_engine_background_encodes_are_on_a_bounded_ledger(
    engine: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    backend = _SlowBackend()
    vllm = VLLMEngine(backend, engine.tokenizer, max_in_flight=1, max_pending=2)
    try:
        assert vllm.encode_in_background([[1], [2]]) == 2
        for _ in range(1000):  # [1] in flight (max_in_flight=1), [2] waits
            if backend.seen:
                break
            threading.Event().wait(0.01)
        assert vllm.encode_in_background([[1], [2]]) == 0  # in flight or queued already
        assert vllm.encode_in_background([[3], [4]]) == 1  # [3] waits too; [4] is skipped
        assert not vllm.wait_for_encoding(timeout=0.05)
        backend.release.set()
        assert vllm.wait_for_encoding(timeout=10)
        assert "background chunk encoding failed" in caplog.text
        assert backend.seen == [[1], [2], [3]] and vllm._background.dropped == 1
    finally:
        backend.release.set()
        vllm.close()
