"""python -m hypertrain.clock: the network clock of finished runs on a cluster (hypertrain.report.retime)."""

import sys

from hypertrain.report.retime import main

sys.exit(main())
