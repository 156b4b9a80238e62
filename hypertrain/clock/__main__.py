"""python -m hypertrain.clock: the network clock of finished runs (hypertrain.clock.cli)."""

import sys

from hypertrain.clock.cli import main

sys.exit(main())
