"""`python -m specheads.inference.cli ...`, the same as the `specheads` console script."""

import sys

from specheads.inference.cli import main

sys.exit(main())
