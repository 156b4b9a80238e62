"""python -m hypertrain.report: the run report (hypertrain.report.cli)."""

import sys

from hypertrain.report.cli import main

sys.exit(main())
