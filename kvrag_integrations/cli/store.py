"""``kvrag store stats|verify|prune``: look after a KV cache store."""

from __future__ import annotations

import argparse
import time

from kvrag_integrations.cli.common import (
    CLIError,
    add_model_options,
    add_store_option,
    engine_from,
    human_bytes,
    store_from,
)
from kvrag_integrations.store.base import KVStore, TempFileInfo
from kvrag_integrations.store.maintenance import (
    find_corrupt,
    prune,
    summarize,
)
from kvrag_integrations.store.quotas import DEFAULT_SHARE, Quotas
from kvrag_integrations.store.tempfiles import STALE_TEMP_S
from kvrag_integrations.store.url import redact_url


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvrag store`` and its actions."""
    parser = subparsers.add_parser("store", help="stats, verify or prune a KV cache store")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")

    stats = actions.add_parser("stats", help="entries, bytes, entries per model fingerprint")
    add_store_option(stats)
    stats.set_defaults(func=run_stats)

    verify = actions.add_parser("verify", help="decode every entry and report corrupt ones")
    add_store_option(verify)
    verify.add_argument("--delete", action="store_true", help="remove the corrupt entries")
    verify.set_defaults(func=run_verify)

    pruning = actions.add_parser("prune", help="evict entries by size, age or model")
    add_store_option(pruning)
    add_model_options(pruning)
    pruning.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help="evict until <= N: least recently used first, of namespaces over their quota "
        "first (as a server's budget holds them)",
    )
    pruning.add_argument("--older-than", type=float, default=None, metavar="DAYS")
    pruning.add_argument(
        "--foreign",
        action="store_true",
        help="evict entries made by another model than --model (or --fingerprint), in "
        "any namespace",
    )
    pruning.add_argument(
        "--fingerprint",
        action="append",
        default=[],
        metavar="FP",
        help="with --foreign: also keep this fingerprint's entries (a vLLM server's: "
        "VLLMEngine.fingerprint, or its log at start); repeatable",
    )
    pruning.add_argument(
        "--namespace-share",
        type=float,
        default=DEFAULT_SHARE,
        help="with --max-bytes: the share each namespace may hold (as serve's)",
    )
    pruning.add_argument(
        "--tenant-keys",
        default=None,
        metavar="FILE",
        help="with --max-bytes: the key file's quota_bytes (as serve's)",
    )
    pruning.add_argument("--dry-run", action="store_true", help="list, do not delete")
    pruning.set_defaults(func=run_prune)


def _stamp(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _sized(n: int) -> str:
    return f"{n} bytes ({human_bytes(n)})"


def _print_reclaimed(files: int, nbytes: int) -> None:
    print(f"reclaimed {files} temp files of dead writers, {_sized(nbytes)}")


def _describe_temp(temp: TempFileInfo, grace_s: float) -> str:
    writer = f"writer {temp.writer}" if temp.writer else "writer unknown (an older version)"
    # Not provably alive, nor dead: another host's writer, or one that names nobody.
    unsure = f"cannot tell from this host, removed once untouched for {grace_s:g} s"
    state = "alive" if temp.alive else unsure
    return f"temp {temp.name} {_sized(temp.nbytes)}, {writer}: {state}"


def run_stats(args: argparse.Namespace) -> int:
    """Print the store's entry count, bytes, age range and fingerprints, its temp
    files apart, and the dead writers' temp files it removed."""
    summary = summarize(store_from(args))
    print(f"store {redact_url(args.store)}")
    print(f"entries {summary.entries}")
    print(f"bytes {summary.nbytes} ({human_bytes(summary.nbytes)})")
    print(f"oldest {_stamp(summary.oldest)}  newest {_stamp(summary.newest)}")
    for fingerprint, count in summary.by_fingerprint.items():
        print(f"fingerprint {fingerprint or '(unreadable)'}: {count}")
    print(f"temp files {summary.temp_files}, {_sized(summary.temp_bytes)} (writes in flight)")
    _print_reclaimed(summary.temp_files_reclaimed, summary.temp_bytes_reclaimed)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    """Decode every entry; exit 1 if corrupt entries remain (found without ``--delete``).
    Also list the temp files of writers that may be alive, and reclaim dead writers'."""
    store: KVStore = store_from(args)
    total = len(store)
    bad = find_corrupt(store, delete=args.delete)
    for key, reason in bad:
        print(f"corrupt {key}: {reason}{' (deleted)' if args.delete else ''}")
    print(f"verified {total} entries: {total - len(bad)} ok, {len(bad)} corrupt", end="")
    print(f", {len(bad)} deleted" if args.delete else "")
    grace_s = getattr(store, "temp_grace_s", STALE_TEMP_S)
    for temp in store.temp_files():
        print(_describe_temp(temp, grace_s))
    _print_reclaimed(*store.reclaim_temp_files())
    return 1 if bad and not args.delete else 0


def _quotas(args: argparse.Namespace) -> Quotas:
    """The quotas a server with these flags keeps its store in."""
    from kvrag_integrations.vllm.keys import KeyFile, namespace_quotas

    if not 0 < args.namespace_share <= 1:
        raise CLIError("--namespace-share is in (0, 1]")
    named = namespace_quotas(KeyFile.load(args.tenant_keys)) if args.tenant_keys else {}
    return Quotas(args.namespace_share, named)


def run_prune(args: argparse.Namespace) -> int:
    """Evict entries by ``--max-bytes``, ``--older-than`` and/or ``--foreign``."""
    if args.max_bytes is None and args.older_than is None and not args.foreign:
        raise CLIError("prune needs at least one of --max-bytes, --older-than, --foreign")
    if (args.max_bytes is not None and args.max_bytes < 0) or (
        args.older_than is not None and args.older_than < 0
    ):
        raise CLIError("--max-bytes and --older-than must be >= 0")
    store = store_from(args)
    foreign_to = [engine_from(args, store).fingerprint, *args.fingerprint] if args.foreign else None
    criteria = {
        "max_bytes": args.max_bytes,
        "older_than_s": None if args.older_than is None else args.older_than * 86400,
        "foreign_to": foreign_to,
        "quotas": _quotas(args),
    }
    chosen = prune(store, dry_run=args.dry_run, **criteria)
    _print_reclaimed(chosen.temp_files_reclaimed, chosen.temp_bytes_reclaimed)
    if chosen.temp_files:
        kept = f"{chosen.temp_files} temp files of writes in flight, {_sized(chosen.temp_bytes)}"
        print(f"kept {kept}", end="")
        print(" (counted toward --max-bytes)" if args.max_bytes is not None else "")
    verb = "would evict" if args.dry_run else "evicted"
    freed = sum(info.nbytes for info in chosen)
    left = len(store) - (len(chosen) if args.dry_run else 0)
    print(f"{verb} {len(chosen)} entries ({human_bytes(freed)}); {left} entries remain")
    return 0
