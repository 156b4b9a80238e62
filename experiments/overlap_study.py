"""The whole-round overlap's study (docs/overlap.md, "Study"; issue 36): DiLoCo, one-outer-step delayed,
delayed with a lower outer learning rate, and eager updates, at H = 4, 8 and 16 on a phase of 192
updates (12 rounds at H = 16), at R = 2 (as the paper) and R = 4. Trains one sweep per (R, H) with the
entry's multirun, then prints the held-out losses and, replayed by the network clock without
retraining (experiments/clock_study.py), the simulated time to each sweep's DiLoCo final loss for a 1B
model on h100 over datacenter_100g, cross_region_10g and internet_1g.

    python experiments/overlap_study.py OUT [--lower-lr 0.35] [--dry-run] [-- EXTRA OVERRIDES]

OUT/r{R}-h{H}/ holds a sweep's four runs. --dry-run prints the commands only. The divergence guard is
off (`guard.enabled=false`): delayed at the default outer lr may climb above the uniform prediction's
loss, and the study records how far rather than stopping it; a failing run is reported, the rest go on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from studies import study_parser

UPDATES = 192
HS = (4, 8, 16)
RS = (2, 4)


def commands(out: Path, lower_lr: float, extra: list[str]) -> list[list[str]]:
    """Per (R, H): none, delayed and eager at the default outer lr, then delayed at `lower_lr`, each its
    own job in the sweep's folder (one failing leaves the others to run)."""
    train = [sys.executable, "-m", "hypertrain.train", "-m", "experiment=quick", f"phase.updates={UPDATES}"]
    out_cmds = []
    for R in RS:
        for H in HS:
            common = [*train, f"replicas={R}", f"inner.H={H}", "logger=none", "guard.enabled=false", *extra]
            common.append(f"hydra.sweep.dir={out / f'r{R}-h{H}'}")
            for job, overlap in enumerate(("none", "delayed", "eager")):
                out_cmds.append([*common, f"outer.overlap={overlap}", f"hydra.sweep.subdir={job}"])
            out_cmds.append(
                [*common, "outer.overlap=delayed", f"outer.lr={lower_lr}", "hydra.sweep.subdir=3"]
            )
    return out_cmds


def main() -> int:
    parser = study_parser(__doc__)
    parser.add_argument("--lower-lr", type=float, default=0.35)
    args = parser.parse_intermixed_args()
    study = commands(args.out, args.lower_lr, args.extra)
    sweeps = [str(args.out / f"r{R}-h{H}") for R in RS for H in HS]
    clock = [sys.executable, str(Path(__file__).with_name("clock_study.py")), *sweeps]
    clock += ["--model-params", "1000000000", "--device", "h100"]
    clock += ["--links", "datacenter_100g", "cross_region_10g", "internet_1g"]
    failed = []
    for cmd in [*study, clock]:
        print(" ".join(cmd), flush=True)
        if not args.dry_run and subprocess.run(cmd).returncode:
            failed.append(" ".join(cmd))
    for cmd in failed:
        print(f"failed: {cmd}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
