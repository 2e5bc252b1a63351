"""``kvrag train``: the command-line front of ``train.trainer``.

``register(subparsers)`` mounts it under a parent CLI; ``python -m
kvrag_integrations.train`` runs it alone.
"""

from __future__ import annotations

import argparse
import json
import time

from kvrag_integrations.train.trainer import TrainConfig, Trainer

_DEFAULTS = TrainConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training options (defaults from ``TrainConfig``)."""
    d = _DEFAULTS
    parser.add_argument("--model", default=None, help="HF id, folder or .gguf (default: SmolLM2)")
    parser.add_argument(
        "--corpus",
        default=None,
        help="JSON or folder of passages + questions.json "
        "(default: ../shared/data/musique_dev.json)",
    )
    parser.add_argument("--out", default=d.out, help="output folder for the adapter")
    parser.add_argument("--max-steps", type=int, default=d.max_steps)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--grad-accum", type=int, default=d.grad_accum)
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    parser.add_argument("--full", action="store_true", help="train every weight (small models)")
    parser.add_argument("--lora-rank", type=int, default=d.lora_rank)
    parser.add_argument("--lora-alpha", type=int, default=d.lora_alpha)
    parser.add_argument("--chunks", type=int, default=d.n_chunks, help="chunks per prompt")
    parser.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens)
    parser.add_argument("--max-answer-tokens", type=int, default=d.max_answer_tokens)
    parser.add_argument("--answers", choices=("teacher", "gold"), default=d.answers)
    parser.add_argument("--ce-weight", type=float, default=d.ce_weight)
    parser.add_argument("--positions", choices=("reordered", "composite"), default=d.positions)
    parser.add_argument("--heldout-fraction", type=float, default=d.heldout_fraction)
    parser.add_argument("--save-every", type=int, default=d.save_every)
    parser.add_argument("--device", default=d.device)
    parser.add_argument("--dtype", default=d.dtype)
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` an argument namespace describes."""
    return TrainConfig(
        out=args.out,
        model=args.model,
        corpus=args.corpus,
        max_steps=args.max_steps,
        lr=args.lr,
        seed=args.seed,
        grad_accum=args.grad_accum,
        warmup_steps=args.warmup_steps,
        full=args.full,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        n_chunks=args.chunks,
        chunk_tokens=args.chunk_tokens,
        max_answer_tokens=args.max_answer_tokens,
        answers=args.answers,
        ce_weight=args.ce_weight,
        positions=args.positions,
        heldout_fraction=args.heldout_fraction,
        save_every=args.save_every,
        device=args.device,
        dtype=args.dtype,
        progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    """Train as ``args`` say; print where the adapter went. Returns the exit status."""
    started = time.perf_counter()
    result = Trainer(config_from_args(args)).fit(resume=args.resume)
    summary = {
        "out": str(result.out),
        "steps": result.steps,
        "first_loss": result.losses[0] if result.losses else None,
        "last10_loss": sum(result.losses[-10:]) / max(1, len(result.losses[-10:])),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` command to a parent CLI's subparsers."""
    parser = subparsers.add_parser(
        "train",
        help="fine-tune a model for TurboRAG's independent chunk caches (self-distillation)",
        description=__doc__,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)
