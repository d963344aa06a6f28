"""`python -m branchspec.bench [flags]`: the same as `branchspec bench`."""

import sys

from branchspec.bench.cli import build_parser, main

if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
