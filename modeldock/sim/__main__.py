"""`python -m modeldock.sim`: the same as `modeldock sim`."""

from __future__ import annotations

import argparse
import sys

from modeldock.sim.cli import add_arguments, run


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m modeldock.sim", description="A vLLM-like simulator.")
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
