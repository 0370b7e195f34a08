"""`python -m k3compile.diff ...`: the graph-diff tool's old address, kept as an entry point only;
the tool is `k3compile.tools.diff` (also `k3compile diff ...`)."""

import sys

from k3compile.tools.diff.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m k3compile.diff"))
