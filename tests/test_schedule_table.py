"""The schedule table (`hypertrain/schedule_table.py`): the only module that tests a schedule's name (no
`is_async`, no name comparison elsewhere, found by the regex docs/extending.md gives), `choices.Schedule` is
its entries, each entry's refusals refuse what they should and pass what they should, and `build` makes
its run-side class.
"""

from __future__ import annotations

import ast
import re
from dataclasses import replace

import pytest
from helpers import REPO

from hypertrain.choices import Schedule
from hypertrain.config import ArrivalsConfig, TrainConfig, UserError
from hypertrain.schedule_table import ENTRIES, TABLE, recorded_entry, schedule_entry

# docs/extending.md's grep, "A schedule": an `is_async`, a comparison with outer.schedule (an attribute
# or a recorded config's key), or an enum member looked up by name
NAME_TEST = re.compile(r'is_async|schedule"?\)? == |Schedule\[')
TABLE_MODULE = REPO / "hypertrain" / "schedule_table.py"


def name_tests(root) -> list[str]:
    """`path:line: text` of every line of a .py file under `root` (but the table's module) the regex finds."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == TABLE_MODULE:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if NAME_TEST.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_no_schedule_name_is_tested_outside_the_tables_module():
    assert name_tests(REPO / "hypertrain") == []


def test_the_scan_finds_each_kind_of_name_test(tmp_path):
    """The scan can fail: each spelling the regex is for, planted, is found."""
    planted = [
        "if cfg.outer.is_async:",
        'if outer.schedule == "async":',
        'if (resolved.get("outer") or {}).get("schedule") == "async":',
        'other = Schedule["rounds"]',
    ]
    (tmp_path / "planted.py").write_text("\n".join(planted) + "\n")
    assert len(name_tests(tmp_path)) == len(planted)


def test_the_enum_is_the_table_in_its_order():
    assert [member.value for member in Schedule] == list(TABLE) == [entry.name for entry in ENTRIES]
    assert all(schedule_entry(member) is TABLE[member.value] for member in Schedule)


def test_the_tables_module_imports_no_torch_and_nothing_of_hypertrain_but_errors():
    """The config and the clock ask it: it stays below them (tests/test_layers.py) and torch-free; it
    imports an entry from outside the package by `import_path` (which imports nothing of hypertrain)."""
    imported = set()
    for node in ast.walk(ast.parse(TABLE_MODULE.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    assert {m for m in imported if m.startswith("hypertrain")} == {
        "hypertrain.errors",
        "hypertrain.import_path",
    }
    assert not {m.split(".")[0] for m in imported} & {"torch", "numpy", "omegaconf", "hydra"}


def with_outer(cfg: TrainConfig, **outer) -> TrainConfig:
    return replace(cfg, outer=replace(cfg.outer, **outer))


def async_run() -> TrainConfig:
    """A config async's entry accepts: modelled compute, everything else at its default."""
    cfg = with_outer(TrainConfig(), schedule=Schedule("async"))
    return replace(cfg, cluster=replace(cfg.cluster, compute="modelled"))


def refusal(check, *args) -> str:
    with pytest.raises(UserError) as caught:
        check(*args)
    message = str(caught.value)
    assert "\n" not in message  # one line
    return message


@pytest.mark.parametrize(
    "name, value", [("rule", "naive"), ("dn_buffer", 3), ("grace_s", 0.5), ("dylu", True)]
)
def test_the_async_node_exists_only_with_async_a_field_of_it_set_under_rounds_is_one_it_lacks(name, value):
    """outer.arrivals is async's node (its entry's `node`): under rounds it is None, at its defaults it is
    dropped, set it is refused in one line naming the field and the schedule it lives under."""
    base = TrainConfig().outer
    assert base.arrivals is None and replace(base, arrivals=ArrivalsConfig()).arrivals is None
    assert replace(base, schedule=Schedule("async")).arrivals == ArrivalsConfig()
    outer = replace(base, arrivals=ArrivalsConfig(**{name: value}))
    assert refusal(outer.check_nodes) == (
        f"outer.arrivals.{name} is not a field of outer.schedule=rounds: outer.arrivals exists only with "
        "outer.schedule=async; valid: outer.schedule=async, or no outer.arrivals.*"
    )
    assert refusal(outer.check).startswith(f"outer.arrivals.{name} is not a field")


def test_rounds_refuses_token_weights_with_eager_overlap_only():
    rounds = schedule_entry("rounds")
    rounds.check(TrainConfig())
    rounds.check(with_outer(TrainConfig(), mean_weights="tokens"))
    rounds.check(with_outer(TrainConfig(), overlap="eager"))
    message = refusal(rounds.check, with_outer(TrainConfig(), mean_weights="tokens", overlap="eager"))
    assert message.startswith("outer.mean_weights=tokens with outer.overlap=eager")


@pytest.mark.parametrize(
    "change, starts",
    [
        ({"cluster.compute": "measured"}, "outer.schedule=async needs modelled compute"),
        ({"outer.fragments": 2}, "outer.schedule=async with outer.fragments=2 is not built"),
        ({"outer.overlap": "delayed"}, "outer.schedule=async with outer.overlap=delayed is not built"),
        ({"outer.delay": 1}, "outer.schedule=async with outer.delay=1 is not built"),
        ({"outer.merge_alpha": 0.5}, "outer.schedule=async with outer.merge_alpha=0.5 is not built"),
        ({"checkpoint.every_updates": 2}, "outer.schedule=async with checkpoint.every_updates=2"),
        ({"churn.min_quorum": 2}, "outer.schedule=async with churn.min_quorum=2 is not built"),
        ({"churn.deadline": 1.0}, "outer.schedule=async with churn.deadline=1.0 is not built"),
        # c <= 1/N, N = dn_buffer or R (R = 2 by default: 1/2)
        (
            {"outer.arrivals": ArrivalsConfig(dn_activation=0.75)},
            "outer.arrivals.dn_activation=0.75 is out of",
        ),
    ],
)
def test_async_refuses_what_needs_a_round_and_measured_compute(change, starts):
    arrivals = schedule_entry("async")
    arrivals.check(async_run())  # the base passes: each case below is refused for its one change
    cfg = async_run()
    for key, value in change.items():
        section, name = key.split(".")
        cfg = replace(cfg, **{section: replace(getattr(cfg, section), **{name: value})})
    assert refusal(arrivals.check, cfg).startswith(starts)


def test_each_entry_builds_its_run_side_class():
    from hypertrain.run.asynchronous import Arrivals
    from hypertrain.run.trainer import Rounds

    built = {entry.name: type(entry.build(*[None] * 7)) for entry in ENTRIES}
    assert built == {"rounds": Rounds, "async": Arrivals}


def test_a_recorded_config_without_a_schedule_ran_rounds():
    assert recorded_entry(None) is recorded_entry({}) is schedule_entry("rounds")
    assert recorded_entry({"schedule": "async"}).arrival_clock
