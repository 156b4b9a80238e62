"""The codecs' study (docs/compression.md, "Study: loss against bits"; issue 37): held-out loss against the
bits each replica sent, for fp32 (none), int8, fp4_e2m1, e3m0, top-k 1% with error feedback, SparseLoCo
(`outer=sparseloco`: k 64 of 4096, 1.6%; and k 128, 3.1%), top-k after the DCT, and PowerSGD's low rank at
r = 1 and 4 (with error feedback), at H = 8 and 30 on a phase of 240 updates (8 rounds at H = 30). Trains
one sweep per H (`experiment=quick`, R = 2, the divergence guard off so a run that climbs is recorded),
then prints one markdown table: each run's final held-out loss, the most bits one replica sent in the run
(`comm/outer_total_bits`), their ratio to fp32's at the same H, and whether the run is on the Pareto front
of all the runs (no other run has both a lower loss and fewer bits), and, replayed by the network clock
without retraining (experiments/clock_study.py), the simulated seconds to each sweep's fp32 final loss
for a 1B-parameter model on h100 over internet_1g.

    python experiments/codec_study.py OUT [--dry-run] [EXTRA OVERRIDES ...]

OUT/h{H}/ holds a sweep's runs, one job per setting. A failing run is reported, the others go on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from studies import study_parser

UPDATES = 240
HS = (8, 30)
SETTINGS = {  # the study's rows: each setting's overrides
    "none": ["outer.compress=none"],
    "int8": ["outer.compress=int8"],
    "fp4_e2m1": ["outer.compress=fp4_e2m1"],
    "e3m0": ["outer.compress=e3m0"],
    "topk 1% +EF": ["outer.compress=topk", "outer.error_feedback=true"],
    "sparseloco 1.6%": ["outer=sparseloco"],
    "sparseloco 3.1%": ["outer=sparseloco", "outer.topk.fraction=0.03125"],
    "dct topk 1% +EF": ["outer.compress=topk", "outer.codec.transform=dct", "outer.error_feedback=true"],
    "lowrank r1 +EF": ["outer.compress=lowrank", "outer.lowrank.rank=1", "outer.error_feedback=true"],
    "lowrank r4 +EF": ["outer.compress=lowrank", "outer.lowrank.rank=4", "outer.error_feedback=true"],
}
CLOCK = ["--model-params", "1000000000", "--device", "h100", "--links", "internet_1g"]


def commands(out: Path, extra: list[str]) -> list[list[str]]:
    train = [sys.executable, "-m", "hypertrain.train", "-m", "experiment=quick", f"phase.updates={UPDATES}"]
    out_cmds = []
    for H in HS:
        common = [*train, f"inner.H={H}", "logger=none", "guard.enabled=false", *extra]
        common.append(f"hydra.sweep.dir={out / f'h{H}'}")
        for job, overrides in enumerate(SETTINGS.values()):
            out_cmds.append([*common, *overrides, f"hydra.sweep.subdir={job}"])
    return out_cmds


def summary(run: Path) -> dict:
    from hypertrain.rundir.records import METRICS_FILE, read_metrics

    merged: dict = {}
    for row in read_metrics(run / METRICS_FILE):
        if row["kind"] == "summary":
            merged |= row
    return merged


def table(out: Path) -> list[str]:
    """The study's table: one row per run, H then setting order, the Pareto front over all runs."""
    rows = []
    for H in HS:
        plain = None
        for job, name in enumerate(SETTINGS):
            got = summary(out / f"h{H}" / str(job))
            loss, bits = got["eval/final_loss"], got["comm/outer_total_bits"]
            plain = bits if plain is None else plain
            rows.append((H, name, loss, bits, plain / bits if bits else float("inf")))
    front = {
        i
        for i, (_, _, loss, bits, _) in enumerate(rows)
        if not any(o[2] < loss and o[3] < bits for o in rows)
    }
    lines = ["| H | setting | held-out final | bits/replica | x below fp32 | Pareto |", "|" + "---|" * 6]
    for i, (H, name, loss, bits, ratio) in enumerate(rows):
        on = "yes" if i in front else ""
        lines.append(f"| {H} | {name} | {loss:.4f} | {bits:,} | {ratio:.1f} | {on} |")
    return lines


def main() -> int:
    parser = study_parser(__doc__)
    args = parser.parse_intermixed_args()
    study = commands(args.out, args.extra)
    clock = [sys.executable, str(Path(__file__).with_name("clock_study.py"))]
    clock += [str(args.out / f"h{H}") for H in HS] + CLOCK
    failed = []
    for cmd in study:
        print(" ".join(cmd), flush=True)
        if not args.dry_run and subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode:
            failed.append(" ".join(cmd))
    if not args.dry_run and not failed:
        print("\n".join(table(args.out)), flush=True)
        print(" ".join(clock), flush=True)
        if subprocess.run(clock).returncode:
            failed.append(" ".join(clock))
    for cmd in failed:
        print(f"failed: {cmd}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
