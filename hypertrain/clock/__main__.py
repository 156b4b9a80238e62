"""python -m hypertrain.clock: the network clock of finished runs on a cluster
(hypertrain.report.clock.retime)."""

import sys

from hypertrain.report.clock.retime import main

sys.exit(main())
