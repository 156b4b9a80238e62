"""docs/sweeps.md's example study: 8 trials of the quick experiment over outer.lr (log scale), outer.momentum
and inner.H with `hydra/sweeper=optuna`, its sampler seeded; prints each trial's proposal, state and final
held-out loss (the sweep's trials.yaml) as docs/sweeps.md's table, then the best trial.

    python experiments/optuna_example.py OUT [--dry-run] [EXTRA OVERRIDES ...]

OUT is the study's sweep directory (a run per trial).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from studies import study_parser

STUDY = [
    "-m",
    "experiment=quick",
    "hydra/sweeper=optuna",
    "hydra.sweeper.n_trials=8",
    "hydra.sweeper.sampler.seed=0",
    "outer.lr=tag(log, interval(0.1, 1.0))",
    "outer.momentum=interval(0.5, 0.95)",
    "inner.H=choice(2, 3, 6)",
]


def table(out: Path) -> list[str]:
    """The trials (trials.yaml) as docs/sweeps.md prints them."""
    import yaml

    lines = ["| trial | outer.lr | outer.momentum | inner.H | state | held-out final |", "|" + "---|" * 6]
    for trial in yaml.safe_load((out / "trials.yaml").read_text()):
        p, values = trial["params"], trial["values"]
        loss = "-" if values is None else f"{values[0]:.4f}"
        cells = [str(trial["number"]), f"{p['outer.lr']:.3f}", f"{p['outer.momentum']:.3f}"]
        cells.append(str(p["inner.H"]))
        lines.append("| " + " | ".join([*cells, trial["state"], loss]) + " |")
    return lines


def main() -> int:
    args = study_parser(__doc__).parse_intermixed_args()
    command = [sys.executable, "-m", "hypertrain.train", *STUDY, "logger=none", *args.extra]
    command.append(f"hydra.sweep.dir={args.out}")
    print(shlex.join(command), flush=True)
    if args.dry_run:
        return 0
    if subprocess.run(command, stdout=subprocess.DEVNULL).returncode:
        return 1
    print("\n".join(table(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
