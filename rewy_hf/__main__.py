"""`python -m rewy_hf` runs the `rewy-hf` command line."""

import sys

from rewy_hf.cli import main

sys.exit(main())
