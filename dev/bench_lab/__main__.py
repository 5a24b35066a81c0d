"""``python $REPO/dev/bench_lab [options]``: the developer bench (``command.main``)."""

import sys
from pathlib import Path

# Run as a folder, this file's own folder leads sys.path; dev/ in its place imports the package as bench_lab.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench_lab.command import main  # noqa: E402

raise SystemExit(main())
