"""python -m hypertrain.plan: show or check the sample plan (hypertrain.plan.check)."""

from hypertrain.plan.check import main

raise SystemExit(main())
