"""Several API processes: ``serve --api-server-count 2``, and ``bench serve`` on it.

One server started with two API processes (vLLM's own ``vllm serve`` path,
``run_multi_api_server``, which ``serve`` runs without the ``vllm`` console
script), on a disk store, with the attack module's key file (its anonymous
callers are the README's: role ``write``, no key). What must hold with N = 2:

- each process installs the hook and the gateway, and both sign admissions with
  the secret the engine's scheduler checks (one secret, inherited);
- the attacks on anonymous callers (``test_vllm_defaults.py``'s: a learned
  prompt's and glue's oracle in cached tokens (their timing is the same code as
  there, and timed there), nothing left in the store, ``/metrics`` closed and
  bad input a 400) and a keyed tenant's five-turn
  chat against vLLM's own prefix cache (``test_vllm_attacks.py``'s): those tests
  are imported here and run against this server (pytest gives them this module's
  ``defaults`` and ``target``);
- ``python -m kvrag_integrations.bench serve`` at smoke size on this server
  (load by vLLM's serving benchmark, the flood beside it), written and rendered.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from test_vllm_attacks import (  # run here, against two API processes
    KEYS,
    Target,
    test_a_keyed_tenants_chat_keeps_vllms_prefix_cache,  # noqa: F401
)
from test_vllm_defaults import (  # run here, against two API processes
    Defaults,
    test_an_anonymous_callers_glue_is_no_oracle_in_cached_tokens_or_time,  # noqa: F401
    test_at_the_defaults_metrics_is_closed_and_bad_input_a_400,  # noqa: F401
    test_no_caller_confirms_a_guess_of_anothers_learned_prompt,  # noqa: F401
    test_nothing_an_anonymous_request_brings_stays_in_the_store,  # noqa: F401
)
from vllm_helpers import Corpus, VLLMServer, needs_vllm

from kvrag_integrations.bench import report, serve_load
from kvrag_integrations.bench.common import write_results
from kvrag_integrations.bench.openai_apps import system_prompt

needs_vllm()
pytest.importorskip("pandas")  # (vLLM's serving benchmark reads its dataset with it)

PROCESSES = 2


class TwoProcesses:
    """The server, its store and its key file."""

    def __init__(self, server: VLLMServer, store: Path, keys: Path) -> None:
        self.server, self.store, self.keys = server, store, keys
        self.url = server.url


@pytest.fixture(scope="module")
def api_server(
    tmp_path_factory: pytest.TempPathFactory, private_vllm_server: Callable[..., VLLMServer]
) -> Iterator[TwoProcesses]:
    workdir = tmp_path_factory.mktemp("vllm-api-servers")
    keys = workdir / "keys.json"
    keys.write_text(json.dumps(KEYS))
    extra = ["--api-server-count", str(PROCESSES), "--tenant-keys", str(keys)]
    server = private_vllm_server(f"disk:{workdir / 'kv'}", *extra)  # two API processes
    try:
        yield TwoProcesses(server, workdir / "kv", keys)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def defaults(api_server: TwoProcesses, musique: Corpus) -> Defaults:
    return Defaults.ingested(api_server.server, api_server.store, musique)


@pytest.fixture
def timed_pairs() -> int:
    """The guess tests here check cached tokens only: the time a guess takes is
    the engine's and the gateway's, the same code with one API process or two,
    and test_vllm_defaults.py times 12 pairs of each (two minutes a run)."""
    return 0


@pytest.fixture(scope="module")
def target(api_server: TwoProcesses, defaults: Defaults) -> Iterator[Target]:
    attacked = Target(api_server.url, f"disk:{api_server.store}", api_server.keys)
    with attacked.honest:
        yield attacked


def test_serve_runs_vllms_serve_path_with_our_middleware(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command ``serve`` runs is vLLM's ``vllm serve`` (its parser and ``cmd``,
    which starts ``--api-server-count`` processes), not the one-process module."""
    from vllm.entrypoints.cli.serve import ServeSubcommand

    from kvrag_integrations.vllm import serve
    from kvrag_integrations.vllm.launch import GATEWAY, INSTALLER, SERVE_MODULE
    from kvrag_integrations.vllm.server import vllm_serve

    serve.main(["--store", "disk:/tmp/kvrag-unused", "--print-command", "--api-server-count", "2"])
    command = shlex.split(capsys.readouterr().out)
    assert command[1:3] == ["-m", SERVE_MODULE]
    seen: dict[str, object] = {}
    monkeypatch.setattr(ServeSubcommand, "cmd", staticmethod(lambda args: seen.update(vars(args))))
    # (not this process's: it would make the in-process engine's workers spawned)
    monkeypatch.setattr("vllm.entrypoints.serve.utils.api_utils.cli_env_setup", lambda: None)
    vllm_serve.main(command[3:])
    assert seen["api_server_count"] == 2 and seen["middleware"] == [GATEWAY, INSTALLER]
    assert seen["enable_prefix_caching"] and "KVRAGConnector" in str(seen["kv_transfer_config"])


def test_each_api_process_has_the_hook_and_the_gateway_and_one_secret(
    api_server: TwoProcesses, defaults: Defaults
) -> None:
    """Both processes install the hook at startup (their log lines); two connections
    held open land one on each (vLLM accepts a connection on the least loaded
    process): on each, bad input is a 400 and ``/metrics`` a 401 (the gateway), and
    stored passages in a new order are loaded (the hook's admission, signed with
    the secret the scheduler checks: a process with another would load nothing)."""
    log = api_server.server.log.read_text()
    installed = re.findall(r"\(ApiServer_(\d+) pid=(\d+)\)[^\n]*kvrag: finds stored passages", log)
    assert sorted(rank for rank, _ in installed) == [str(i) for i in range(PROCESSES)], installed
    assert len({pid for _, pid in installed}) == PROCESSES
    a, b, c = defaults.passages
    body = {"model": defaults.model, "max_tokens": 1, "temperature": 0}
    clients = [httpx.Client(base_url=api_server.url, timeout=300) for _ in range(PROCESSES)]
    try:
        for client in clients:  # each opens its connection, and keeps it
            assert client.get("/health").status_code == 200
        for i, client in enumerate(clients):
            assert client.post("/v1/completions", json={**body, "cache_salt": 7}).status_code == 400
            assert client.get("/metrics").status_code == 401
            prompt = system_prompt("\n\n".join([c, a, b][i:] + [c, a, b][:i])) + "\n\nWhy?"
            reply = client.post("/v1/completions", json={**body, "prompt": prompt})
            usage = reply.raise_for_status().json()["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 0.8 * usage["prompt_tokens"], (i, usage)
    finally:
        for client in clients:
            client.close()


def test_bench_serve_at_smoke_size_on_two_api_processes(
    api_server: TwoProcesses, musique: Corpus, tmp_path: Path
) -> None:
    """(Last here: its flood stores entries the store checks above do not expect.)"""
    options = {k: v for k, v in serve_load.QUICK.items() if k != "items"}
    items = musique.items[: serve_load.QUICK["items"]]
    payload = serve_load.run(None, items, urls={"kvrag": api_server.url}, **options)
    payload["command"] = "bench serve --quick (on the test's server)"
    ours = payload["servers"]["kvrag"]
    (level,) = options["concurrencies"]
    run = ours["runs"][level]
    assert run["completed"] == payload["requests"][level] and run["failed"] == 0
    assert run["median_ttft_ms"] > 0 and run["output_throughput"] > 0
    assert "--max-concurrency 2" in run["vllm_bench_args"]
    assert ours["cached_share"] >= 0.5  # the stored passages found in new orders
    flooded = ours["flood"]
    assert flooded["run"]["completed"] == payload["requests"][level]
    sent = flooded["flooder"]["counts"]
    assert {k.split()[0] for k in sent} == set(serve_load.KINDS)  # every kind of abuse
    assert not any(k.endswith("failed") for k in sent), sent  # answered: the server stayed up
    assert payload["summary"]["flood"]["kvrag"]["p99_ratio"] > 0
    write_results(tmp_path, "serve", payload, serve_load.table(payload))
    docs, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    readme.write_text(f"{report.START}\n{report.END}\n")
    report.main(["--results", str(tmp_path), "--docs", str(docs), "--readme", str(readme)])
    text = docs.read_text()
    assert "## Load: our server against vLLM alone" in text and "beside the flood" in text
