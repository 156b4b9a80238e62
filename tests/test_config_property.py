"""Every numeric config field, at any value (negative, zero, huge, beyond 64 bits, nan, inf, the
wrong type): the preflight accepts it or refuses it with one line, never a traceback (issue 35,
"Proof"). A property test over the fields of `TrainConfig` (hypothesis, derandomized so CI is
stable), then a pinned sample of accepted extremes run for two updates through the command line:
each ends finished, or with one line and its documented code (docs/errors.md: 1, run failed), and
every record it wrote is JSON (`read_metrics` reads strictly).

The preflight here is the entry's own (`run.preflight.prepare_checked`, run_dir None: no directory
or W&B, which have their own tests), on a config composed once and edited as a `key=value`
override edits it: OmegaConf refusing the value's type is Hydra's composition error, which the
entry prints as one line (`composition_error`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing

import pytest
from helpers import QUICK, compose_train, in_process, quote_numeric_choices, stderr_lines
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from hypertrain.config import TrainConfig, UserError
from hypertrain.plan.sampling import PlanError
from hypertrain.preflight.checked import prepare_checked
from hypertrain.preflight.composition import composition_error
from hypertrain.rundir.records import read_metrics


def numeric_fields(schema: type, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted key, int or float) for every field of `schema` typed int or float (or Optional), in its
    sections and nodes (a node some runs lack, `X | None`, too)."""
    hints = typing.get_type_hints(schema)
    found = []
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        node = next((k for k in (kind, *typing.get_args(kind)) if dataclasses.is_dataclass(k)), None)
        if node is not None:
            found += numeric_fields(node, f"{prefix}{f.name}.")
            continue
        bases = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        if len(bases) == 1 and bases[0] in (int, float):
            found.append((f"{prefix}{f.name}", bases[0]))
    return found


FIELDS = numeric_fields(TrainConfig)
EDGES = [0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]
FLOAT_EDGES = [0.0, -0.0, 0.5, -1e-300, 1e-300, 5e-324, 1e300, -1e300, math.nan, math.inf, -math.inf]
VALUES = st.one_of(
    st.sampled_from(EDGES + FLOAT_EDGES),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
)


@pytest.fixture(scope="module")
def base():
    return compose_train(quote_numeric_choices([*QUICK, "logger=none"]))


def test_every_section_has_numeric_fields_and_the_walk_finds_them():
    """The property below is only as wide as this list: it holds the fields of every section."""
    sections = {key.split(".")[0] for key, _ in FIELDS if "." in key}
    assert {"model", "inner", "outer", "data", "cluster", "churn", "checkpoint", "guard"} <= sections
    assert ("seed", int) in FIELDS and ("cluster.straggler.sigma", float) in FIELDS


def preflight_outcome(base, key: str, value) -> str | None:
    """The preflight of `base` with `key=value`: None when accepted, else its one line; a traceback
    (any other exception) propagates and fails the test."""
    cfg = copy.deepcopy(base)
    try:
        OmegaConf.update(cfg, key, value, merge=False)
    except Exception as e:  # OmegaConf refusing the type: the entry's composition error, one line
        line = composition_error(e)
        assert line and "\n" not in line.strip(), (key, value, line)
        return line
    try:
        prepare_checked(cfg, {}, None)
    except (UserError, PlanError) as e:
        assert str(e) and "\n" not in str(e), (key, value, str(e))
        return str(e)
    return None


# Each field at the edges of its own type: the values a wrong sign, an overflow or a non-number
# would hit first (a value of the other type is the property test's).
INT_EDGES = [-1, -(2**63) - 1, 2**63 - 1, 2**64]
FLOAT_EDGES_OWN = [-1e300, 1e300, 5e-324, math.nan, math.inf, -math.inf]


@pytest.mark.slow  # 84 fields, 4 or 6 values each, up to 0.25 s a value (the preflight prepares the data)
@pytest.mark.parametrize("field", FIELDS, ids=[key for key, _ in FIELDS])
def test_each_numeric_field_at_its_edges_is_accepted_or_refused_in_one_line(base, field):
    key, kind = field
    for value in INT_EDGES if kind is int else FLOAT_EDGES_OWN:
        preflight_outcome(base, key, value)


@pytest.mark.slow  # about 0.25 s an example (the preflight prepares the data and the plan), 120 examples
@settings(
    max_examples=120,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(field=st.sampled_from(FIELDS), value=VALUES)
def test_the_preflight_accepts_any_number_or_refuses_it_in_one_line(base, field, value):
    preflight_outcome(base, field[0], value)


# Accepted extremes (the property above accepts each): two updates through the command line. Those
# that make the arithmetic overflow end with exit 1 and one line (a NaN loss, or a NaN held-out loss
# that JSON cannot hold); the rest finish.
DIVERGE = {
    "inner.lr=1e300": "its loss is nan",
    "inner.wd=1e300": "its loss is nan",
    "inner.eps=1e-300": "its loss is nan",  # AdamW's step m / (sqrt(v) + eps) with v = 0 in fp32 ulps
    "model.init_std=1e300": "eval_loss=nan",  # the weights are inf in fp32 before any step
    "guard.pseudo_grad_ratio=1e-300": "diverged",  # any pseudo-gradient is more than 1e-300 times
}
FINISH = [
    f"inner.H={2**63 - 1}",
    "seed=-1",
    f"seed={2**63 - 1}",
    "guard.heldout_margin=1e300",
    "cluster.peak_tflops=1e300",
    "churn.mean_absence=1e300",
    f"data.max_examples={10**18}",
    f"engine.stack={2**63 - 1}",
    f"checkpoint.every={2**63 - 1}",
    f"inner.warmup_steps={2**63 - 1}",
    "inner.grad_clip=1e-300",
    "model.norm_eps=1e300",
]


@pytest.mark.slow  # about 1.2 s a case, 17 cases
@pytest.mark.parametrize("override", [*DIVERGE, *FINISH])
def test_an_accepted_extreme_runs_to_its_end_or_stops_with_one_line(tmp_path, override):
    run_dir = tmp_path / "run"
    overrides = [*QUICK, "logger=none", "phase.updates=2", override, f"hydra.run.dir={run_dir}"]
    done = in_process(overrides, tmp_path)
    lines = stderr_lines(done.stderr)
    rows = read_metrics(run_dir / "metrics.jsonl")  # strictly: no NaN or Infinity token
    if override in DIVERGE:
        assert done.returncode == 1 and len(lines) == 1, done.stderr
        assert lines[0].startswith("hypertrain: error: run failed:") and DIVERGE[override] in lines[0]
        assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "failed"
    else:
        assert done.returncode == 0 and lines == [], done.stderr
        assert rows[-1]["kind"] == "end" and rows[-1]["status"] == "finished"
