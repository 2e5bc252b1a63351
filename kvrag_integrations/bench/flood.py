"""One anonymous client flooding a server beside the load (``bench serve``'s abuse run).

The flooder sends no key and no ``cache_salt`` (but where it makes up salts), as
any client that reaches the port may, ``concurrency`` requests in flight at all
times until stopped, cycling through what costs the server most per request:

- ``glue``: stored passages with a new note between them each time (glue the
  server encodes for that request alone);
- ``prefix``: a new text of ~1.5k tokens of made-up words before stored
  passages (longer than the server computes as a prefix, ``MAX_PREFIX_TOKENS``:
  the whole ~5k-token prompt is computed);
- ``save``: a new prompt of token ids with a ``save`` of the whole of it (what an
  anonymous writer may ask the server to store);
- ``beam``: beam search (width 4, 8 tokens) over stored passages in a new order
  (vLLM's server runs one request per beam and step, each through the hook);
- ``salts``: a new ``cache_salt`` each time, over stored passages and a new line
  (a tenant of its own each: the server learns each prompt in its namespace).

It sends from an address of its own (``source_address``; ``bench serve`` takes
``LOOPBACK_FLOODER``, another loopback address than the load's), as a flooder
on the network does: the server tells callers apart by their address.

What it did is counted per kind (answered 200, refused 4xx, failed; ``cut``:
still in flight when it was stopped, its connection closed, which aborts it on
the server), with each request's seconds.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import Counter
from typing import Any

import httpx

KINDS = ("glue", "prefix", "save", "beam", "salts")
PREFIX_WORDS = 220  # ~1.5k tokens of made-up words (SmolLM2 splits their digits)
MAX_TOKENS = 4
GRACE_S = 10.0  # how long ``stop`` lets requests in flight finish before cutting them
LOOPBACK_FLOODER = "127.0.0.2"  # Linux routes all of 127.0.0.0/8 to the loopback device


class Flood:
    """The flooding client, on ``concurrency`` threads, from ``start`` to ``stop``
    (``source_address``: the local address it sends from; None: the system's)."""

    def __init__(
        self,
        url: str,
        model: str,
        passage_sets: list[list[str]],
        tokenizer: Any,
        concurrency: int = 4,
        kinds: tuple[str, ...] = KINDS,
        source_address: str | None = None,
    ) -> None:
        self.url, self.model, self.sets = url, model, passage_sets
        self.source_address = source_address
        self.tokenizer, self.concurrency, self.kinds = tokenizer, concurrency, kinds
        self.counts: Counter[str] = Counter()
        self.seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._clients: list[httpx.Client] = []
        self._lock = threading.Lock()

    def start(self) -> Flood:
        for i in range(self.concurrency):
            transport = httpx.HTTPTransport(local_address=self.source_address)
            client = httpx.Client(base_url=f"{self.url}/v1", timeout=600, transport=transport)
            thread = threading.Thread(target=self._worker, args=(i, client), daemon=True)
            self._clients.append(client)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, grace_s: float = GRACE_S) -> dict[str, Any]:
        """Stop: requests in flight get ``grace_s`` seconds, then their connections
        are closed (the server aborts them); say what was sent."""
        self._stop.set()
        deadline = time.monotonic() + grace_s
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for client in self._clients:
            client.close()
        for thread in self._threads:
            thread.join(timeout=60)
        return {
            "concurrency": self.concurrency,
            "counts": dict(sorted(self.counts.items())),
            "median_s": {
                kind: round(sorted(s)[len(s) // 2], 3) for kind, s in self.seconds.items() if s
            },
        }

    def _worker(self, index: int, http: httpx.Client) -> None:
        rng = random.Random(index)
        step = index
        while not self._stop.is_set():
            kind = self.kinds[step % len(self.kinds)]
            step += 1
            started = time.perf_counter()
            try:
                status = http.post("/completions", json=self.body(kind, rng)).status_code
                outcome = "ok" if status == 200 else f"{status // 100}xx"
            except (httpx.HTTPError, RuntimeError):  # (RuntimeError: closed by stop)
                outcome = "cut" if self._stop.is_set() else "failed"
                if outcome == "failed":
                    time.sleep(1.0)  # (a server that went away: no busy loop)
            with self._lock:
                self.counts[f"{kind} {outcome}"] += 1
                self.seconds[kind].append(time.perf_counter() - started)

    def body(self, kind: str, rng: random.Random) -> dict[str, Any]:
        """One flood request of ``kind`` (``KINDS``), new in what it brings."""
        passages = list(self.sets[rng.randrange(len(self.sets))])
        rng.shuffle(passages)
        new = uuid.uuid4().hex
        body: dict[str, Any] = {"model": self.model, "max_tokens": MAX_TOKENS, "temperature": 0}
        if kind == "glue":
            notes = [f"Note {new[:8]}-{i}: read this passage next." for i in range(len(passages))]
            body["prompt"] = "\n\n".join(p for pair in zip(passages, notes) for p in pair)
        elif kind == "prefix":
            words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(PREFIX_WORDS))
            body["prompt"] = f"{words}\n\n" + "\n\n".join(passages) + "\n\nWhy?"
        elif kind == "save":
            text = f"{new} " + " ".join(passages[0].split()[:200])
            ids = self.tokenizer(text)["input_ids"]
            body["prompt"] = ids
            body["kv_transfer_params"] = {"kvrag": {"save": [[0, len(ids), []]]}}
        elif kind == "beam":
            body.update(prompt="\n\n".join(passages) + "\n\nAnswer:", use_beam_search=True, n=4)
            body["max_tokens"] = 8
        elif kind == "salts":
            body["prompt"] = "\n\n".join(passages) + f"\n\nQuestion {new}: why?"
            body["cache_salt"] = f"flood-{new}"
        else:
            raise ValueError(f"unknown flood kind {kind!r}; known: {', '.join(KINDS)}")
        return body
