"""``kvrag calibrate``: measure blend's settings on your chunks and record the choice.

Runs blend's candidate settings on a sample of your chunks (the store's, or a
file's) against full prefill (``kvrag_integrations.calibration``), keeps the
cheapest whose first-token KL is at most ``--bound`` times turbo's (the upper
end of its 90% interval over the sample), and records
it in the store under the model's checkpoint identity: every engine, process
and vLLM replica serving that model on the store then uses it for
``strategy="blend"``.
"""

from __future__ import annotations

import argparse
import sys

from kvrag_integrations.calibration import (
    AGREEMENT,
    BOUND,
    RATIOS,
    RECOMPUTE_FIRST,
    SELECTIONS,
    calibrate,
    chunks_from_file,
    chunks_from_store,
    families,
    prompts_from_items,
    recorded,
    sample_prompts,
    trimmed,
)
from kvrag_integrations.cli.common import add_model_options, add_store_option, engine_from
from kvrag_integrations.cli.common import store_from as open_cli_store
from kvrag_integrations.engine.prompting.segments import CHUNK_CONTEXTS


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``kvrag calibrate``."""
    parser = subparsers.add_parser(
        "calibrate",
        help="measure blend's settings on your chunks and record the cheapest that keeps "
        "its answers close to full prefill",
    )
    add_store_option(parser)
    add_model_options(parser)
    parser.add_argument(
        "--chunks",
        default=None,
        metavar="FILE",
        help="chunk texts (JSON list, MuSiQue items, JSON lines or blank-line separated "
        "text); default: the chunks stored for this model",
    )
    parser.add_argument(
        "--questions", default=None, metavar="FILE", help="questions, one per line (default: "
        "a question about a name in one of each prompt's chunks)"
    )  # fmt: skip
    parser.add_argument(
        "--items",
        default=None,
        metavar="FILE[:FIRST:LAST]",
        help="RAG items instead (a JSON list of {question, ctxs: [{text}]}, MuSiQue's "
        "form): each prompt is an item's question over its own passages; FIRST:LAST picks "
        "a slice (keep the items you evaluate on out of it)",
    )
    parser.add_argument("--prompts", type=int, default=24, help="sample prompts (default: 24)")
    parser.add_argument(
        "--chunks-per-prompt", type=int, default=10, help="chunks in each prompt (default: 10)"
    )
    parser.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="cut each chunk to about this many tokens (default: 0, as they are)",
    )
    parser.add_argument(
        "--bound",
        type=float,
        default=BOUND,
        help="blend's KL at most this multiple of turbo's, the upper end of its 90%% "
        f"interval over the sample (default: {BOUND})",
    )
    parser.add_argument(
        "--agreement",
        type=float,
        default=AGREEMENT,
        help="... and its answers' F1 against full prefill's at least this above turbo's "
        f"(default: {AGREEMENT})",
    )
    parser.add_argument(
        "--ratios",
        default=",".join(f"{r:g}" for r in RATIOS),
        help="recompute ratios tried, ascending (default: %(default)s)",
    )
    parser.add_argument(
        "--contexts",
        default=",".join(CHUNK_CONTEXTS),
        help="encoding contexts tried (default: %(default)s)",
    )
    parser.add_argument(
        "--selections", default=",".join(SELECTIONS), help="selections tried (default: %(default)s)"
    )
    parser.add_argument(
        "--recompute-first",
        default=",".join(str(n) for n in RECOMPUTE_FIRST),
        help="chunk-start counts tried, EPIC's (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    parser.add_argument("--dry-run", action="store_true", help="measure and print, do not record")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    ratios = sorted(float(r) for r in _listed(args.ratios))
    tried = families(
        _listed(args.contexts),
        _listed(args.selections),
        [int(n) for n in _listed(args.recompute_first)],
    )
    store = open_cli_store(args)
    engine = engine_from(args, store)
    if args.items:
        path, _, span = args.items.partition(":")
        first, _, last = span.partition(":")
        prompts = prompts_from_items(
            path, int(first or 0), int(last) if last else None, args.chunks_per_prompt
        )[: args.prompts]
    else:
        chunks = chunks_from_file(args.chunks) if args.chunks else chunks_from_store(engine)
        questions = []
        if args.questions:
            with open(args.questions, encoding="utf-8") as handle:
                questions = [line.strip() for line in handle if line.strip()]
        prompts = sample_prompts(
            chunks,
            prompts=args.prompts,
            chunks_per_prompt=args.chunks_per_prompt,
            questions=questions,
            seed=args.seed,
        )
    if args.chunk_tokens:
        prompts = [trimmed(engine, p, args.chunk_tokens) for p in prompts]
    passages = len({c for p in prompts for c in p.chunks})
    print(f"calibrating {engine.loaded.name} on {len(prompts)} prompts of {passages} chunks")
    choice, rows = calibrate(
        engine,
        prompts,
        bound=args.bound,
        agreement=args.agreement,
        ratios=ratios,
        candidate_families=tried,
        progress=lambda line: print("  " + line, flush=True),
    )
    verdict = "meets" if choice.bound_met else "does NOT meet"
    print(
        f"chosen for ~{choice.chunk_tokens}-token chunks: {choice.settings.label}: KL "
        f"{choice.blend_kl:.4f} = {choice.kl_ratio:.2f}x turbo's, answers' F1 against "
        f"full's {choice.blend_f1:.2f} (turbo's {choice.turbo_f1:.2f}); {verdict} the "
        f"bound; computes {choice.cost:.2f} of the prompt, {choice.time_share:.2f} of full "
        "prefill's time to first token"
    )
    if args.dry_run:
        return 0
    sample = args.items or args.chunks or "store"
    calibration = recorded(engine, choice, rows, args.bound, sample)
    engine.calibrations.save(calibration)
    print(f"recorded as {calibration.record_name} in the store", file=sys.stderr)
    return 0


def _listed(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]
