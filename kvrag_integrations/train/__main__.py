"""``python -m kvrag_integrations.train``: the same as ``kvrag train``."""

import argparse
import sys

from kvrag_integrations.train.cli import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m kvrag_integrations.train")
add_arguments(parser)
sys.exit(run(parser.parse_args()))
