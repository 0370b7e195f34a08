"""`python -m k3compile.tools.diff ...`."""

import sys

from k3compile.tools.diff.cli import main

sys.exit(main())
