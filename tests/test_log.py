"""metrics.jsonl is the source of truth and a real offline W&B run mirrors it (read back from .wandb)."""

from __future__ import annotations

import json
import math
import os

import pytest

from hypertrain.config import LoggerConfig
from hypertrain.failures import NonFiniteError
from hypertrain.rundir.records import RunLogger, loss_mean, read_metrics
from hypertrain.rundir.wandb_offline import WandbFileError, has_exit_record, read_run

CONFIG = {"replicas": 2, "seed": 0, "inner": {"name": "adamw", "H": 2, "lr": 0.003}, "world": {"size": 8}}
SUMMARY = {
    "plan/union_sha256": "bb5c" * 16,
    "plan/data_order_sha256": "0f" * 32,
    "data/fingerprint": "abc123",
}
UPDATES = [
    {
        "update": 0,
        "round": 0,
        "lr": 1e-3,
        "loss": [5.5, 5.25],
        "tokens": 640,
        "wall": 0.5,
        "steps_per_s": 4.0,
    },
    {"update": 1, "round": 0, "lr": 2e-3, "loss": [5.0, None], "tokens": 320, "wall": 0.9},
    {"update": 2, "round": 1, "lr": 3e-3, "loss": [4.5, 4.75], "tokens": 640, "wall": 1.4},
]
SYNCS = [
    {
        "update": 1,
        "round": 0,
        "eval_loss": 5.1,
        "pseudo_grad_norm": 0.25,
        "comm_inner_bytes": 1000,
        "comm_outer_bytes": 300,
        "comm_inner_total": 1000,
        "comm_outer_total": 300,
        "replicas_stepped": 2,
    },
    {
        "update": 2,
        "round": 1,
        "eval_loss": 4.6,
        "pseudo_grad_norm": 0.125,
        "comm_inner_bytes": 500,
        "comm_outer_bytes": 300,
        "comm_inner_total": 1500,
        "comm_outer_total": 600,
        "replicas_stepped": 2,
    },
]


@pytest.fixture
def offline_env(monkeypatch, tmp_path):
    """W&B offline, silent, and kept away from the user's own W&B settings and caches."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    return monkeypatch


def open_logger(run_dir, name="wandb", replicas=2, config=CONFIG):
    return RunLogger(
        run_dir,
        config,
        LoggerConfig(name=name, project="hypertrain-test"),
        name="smoke-R2-H2",
        group="default",
        job_type="strong",
        tags=["world=8", "R=2", "H=2"],
        replicas=replicas,
    )


def close_or_nan(a, b):
    return (a is None and b is None) or (math.isnan(a) and math.isnan(b)) or math.isclose(a, b)


def test_offline_wandb_run_mirrors_metrics_jsonl(offline_env, tmp_path):
    with open_logger(tmp_path / "run") as log:
        log.log_eval(0, 5.75)
        for row in UPDATES[:2]:
            log.log_update(row)
        log.log_sync(SYNCS[0])
        log.log_update(UPDATES[2])
        log.log_sync(SYNCS[1])
        log.summary(SUMMARY)
        wandb_dir = log.wandb_run_dir
    assert wandb_dir.parent == tmp_path / "run" / "wandb" and wandb_dir.name.startswith("offline-run-")

    rows = read_metrics(tmp_path / "run")
    kinds = ["start", "eval", "update", "update", "sync", "update", "sync", "summary", "end"]
    assert [r["kind"] for r in rows] == kinds
    updates = [r for r in rows if r["kind"] == "update"]
    assert [u["loss"] for u in updates] == [u["loss"] for u in UPDATES]
    assert [u["loss_mean"] for u in updates] == [5.375, 5.0, 4.625]
    assert rows[0]["wandb_run_id"] == wandb_dir.name.rsplit("-", 1)[1]

    run = read_run(wandb_dir)
    assert run["exit_code"] == 0
    assert run["run"]["group"] == "default" and run["run"]["job_type"] == "strong"
    assert run["run"]["tags"] == ["world=8", "R=2", "H=2"] and run["run"]["name"] == "smoke-R2-H2"
    assert {"name": "*", "step_metric": "update"} in run["metrics"]
    assert {k: run["config"][k] for k in CONFIG} == CONFIG
    assert {k: run["summary"][k] for k in SUMMARY} == SUMMARY

    history = run["history"]
    assert len(history) == 1 + len(UPDATES) + len(SYNCS)  # one W&B row per metrics.jsonl row
    assert history[0]["update"] == 0 and history[0]["eval/loss"] == 5.75
    train = [h for h in history if "train/lr" in h]
    for logged, row in zip(train, updates, strict=True):
        assert logged["update"] == row["update"] and logged["round"] == row["round"]
        for m, loss in enumerate(row["loss"]):
            assert close_or_nan(logged.get(f"train/loss/replica_{m}"), loss)  # a skipped replica is absent
        assert close_or_nan(logged["train/loss_mean"], row["loss_mean"])
        for key in ("lr", "tokens", "wall"):
            assert logged[f"train/{key}"] == row[key]
    assert train[0]["train/steps_per_s"] == 4
    synced = [h for h in history if "eval/loss" in h and "comm/inner_bytes" in h]
    for logged, row in zip(synced, SYNCS, strict=True):
        assert logged["update"] == row["update"] and logged["eval/loss"] == row["eval_loss"]
        assert logged["sync/pseudo_grad_norm"] == row["pseudo_grad_norm"]
        for key in ("inner_bytes", "outer_bytes", "inner_total", "outer_total"):
            assert logged[f"comm/{key}"] == row[f"comm_{key}"]
        assert logged["sync/replicas_stepped"] == row["replicas_stepped"]


def test_a_run_that_starts_wandb_keeps_wandbs_service_log_in_its_own_folder(offline_env, tmp_path):
    """wandb's service writes a core-debug-*.log into $WANDB_CACHE_DIR/wandb/logs/, ~/.cache/wandb/logs/
    by default: outside the run. A run that starts the service (no WANDB_CACHE_DIR of the user's) keeps
    the log in its own wandb/ folder, stops the service at its close, and leaves the environment and
    $HOME as they were."""
    import wandb

    from hypertrain.rundir.wandb_settings import wandb_is_set_up

    wandb.teardown()  # a service an earlier test in this process left up would be this run's
    home = tmp_path / "home"
    home.mkdir()
    offline_env.setenv("HOME", str(home))
    offline_env.delenv("WANDB_CACHE_DIR")
    offline_env.delenv("XDG_CACHE_HOME", raising=False)
    with open_logger(tmp_path / "run") as log:
        log.log_update(UPDATES[0])
    assert len(list((tmp_path / "run" / "wandb" / "logs").glob("core-debug-*.log"))) == 1
    assert list(home.rglob("*")) == []
    assert "WANDB_CACHE_DIR" not in os.environ and not wandb_is_set_up()


def test_records_larger_than_a_block_read_back(offline_env, tmp_path):
    # The run record (it holds the config) spans four 32 KiB blocks: FIRST, MIDDLE and LAST chunks.
    notes = {f"notes_{j:02d}": {f"key_{i:03d}": f"value {j}.{i} " * 3 for i in range(100)} for j in range(30)}
    big_config = {**CONFIG, **notes}
    with open_logger(tmp_path / "run", config=big_config) as log:
        for u in range(400):
            log.log_update({"update": u, "round": u // 10, "lr": 1e-3, "loss": [1.0 / (u + 1), None]})
        wandb_dir = log.wandb_run_dir
    run = read_run(wandb_dir)
    run_file = next(wandb_dir.glob("*.wandb"))
    assert run_file.stat().st_size > 4 * 32 * 1024
    assert has_exit_record(run_file)  # found from the last blocks alone
    assert {k: run["config"][k] for k in notes} == notes
    losses = [h["train/loss/replica_0"] for h in run["history"]]
    assert losses == pytest.approx([1.0 / (u + 1) for u in range(400)], rel=1e-15)
    assert run["exit_code"] == 0

    cut = tmp_path / "killed.wandb"  # a run killed mid-write: the records before the cut read back
    cut.write_bytes(run_file.read_bytes()[: run_file.stat().st_size * 2 // 3])
    partial = read_run(cut)
    assert partial["exit_code"] is None and not has_exit_record(cut)
    assert 0 < len(partial["history"]) < 400 and partial["config"]["notes_00"] == notes["notes_00"]


def test_error_in_run_finishes_wandb_with_nonzero_exit_code(offline_env, tmp_path):
    with pytest.raises(RuntimeError, match="diverged"):
        with open_logger(tmp_path / "run") as log:
            log.log_update(UPDATES[0])
            wandb_dir = log.wandb_run_dir
            raise RuntimeError("diverged")
    run = read_run(wandb_dir)
    assert run["exit_code"] == 1
    assert len(run["history"]) == 1
    rows = read_metrics(tmp_path / "run")
    assert [r["kind"] for r in rows] == ["start", "update", "end"]
    assert rows[-1] | {"time": 0} == {
        "kind": "end",
        "time": 0,
        "status": "failed",
        "error": "diverged",
        "exit_code": 1,
    }


def test_existing_metrics_jsonl_is_appended_not_truncated(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = '{"kind": "update", "update": 0}\n{"kind": "update", "update": 1}'  # no final newline
    (run_dir / "metrics.jsonl").write_text(earlier)
    with open_logger(run_dir, name="none") as log:
        log.log_update(UPDATES[2])
    rows = read_metrics(run_dir)
    assert rows[:2] == [{"kind": "update", "update": 0}, {"kind": "update", "update": 1}]
    assert [r["kind"] for r in rows[2:]] == ["start", "update", "end"]
    assert (run_dir / "metrics.jsonl").read_text().startswith(earlier + "\n")


def test_logger_none_writes_only_metrics_jsonl(tmp_path):
    with open_logger(tmp_path / "run", name="none") as log:
        log.log_eval(0, 6.0)
        log.log_update(UPDATES[0])
        log.log_sync(SYNCS[0])
        log.summary(SUMMARY)
        assert log.wandb_run_dir is None
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]
    assert [r["kind"] for r in read_metrics(tmp_path / "run")] == [
        "start",
        "eval",
        "update",
        "sync",
        "summary",
        "end",
    ]


def test_wandb_mode_environment_variable_wins(offline_env, tmp_path):
    offline_env.setenv("WANDB_MODE", "disabled")
    with open_logger(tmp_path / "run") as log:
        log.log_update(UPDATES[0])
        assert log.wandb_run_dir is None
    assert not (tmp_path / "run" / "wandb").exists()
    assert read_metrics(tmp_path / "run")[0]["wandb_run_id"] is None


def test_update_row_needs_one_loss_per_replica(tmp_path):
    with open_logger(tmp_path / "run", name="none", replicas=3) as log:
        with pytest.raises(ValueError, match="one per replica"):
            log.log_update(UPDATES[0])


def test_close_is_idempotent_and_rows_after_close_fail(tmp_path):
    log = open_logger(tmp_path / "run", name="none")
    with log:
        log.close()
        log.close()
    with pytest.raises(RuntimeError, match="not open"):
        log.log_update(UPDATES[0])
    assert [r["kind"] for r in read_metrics(tmp_path / "run")] == ["start", "end"]  # one end row


def test_loss_mean_leaves_out_skipped_replicas():
    assert loss_mean([1.0, None, 2.0]) == 1.5
    assert loss_mean([None, None]) is None


def test_read_metrics_names_a_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"kind": "update"}) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2 is not a JSON line"):
        read_metrics(path)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_read_metrics_refuses_a_number_json_has_not(tmp_path, token):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"kind": "update"}) + f'\n{{"kind": "update", "clock_s": {token}}}\n')
    with pytest.raises(
        ValueError, match=rf"metrics.jsonl:2 is not a JSON line \({token} is not a JSON number\)"
    ):
        read_metrics(path)


@pytest.mark.parametrize(
    "row, key",
    [
        ({**UPDATES[0], "clock_s": math.inf}, "clock_s=inf"),
        ({**UPDATES[0], "loss": [5.5, math.nan]}, "loss[1]=nan"),
        ({**UPDATES[0], "channel_loss": [1.0, -math.inf]}, "channel_loss[1]=-inf"),
    ],
)
def test_a_row_holding_nan_or_inf_stops_the_run_and_is_never_written(tmp_path, row, key):
    """JSON has no nan or infinity (Python's json would write the tokens NaN and Infinity): the writer
    stops the run with one line (NonFiniteError, exit 1) and the end row holds it; every line stays JSON."""
    with pytest.raises(NonFiniteError) as stopped:
        with open_logger(tmp_path / "run", name="none") as log:
            log.log_update(UPDATES[0])
            log.log_update(row)
    line = str(stopped.value)
    assert line == (
        f"the update row of update 0 holds {key}, a number JSON cannot hold (metrics.jsonl's rows are JSON); "
        "the run stops"
    )
    rows = read_metrics(tmp_path / "run")  # strictly: NaN and Infinity are refused
    assert [r["kind"] for r in rows] == ["start", "update", "end"]
    assert (rows[-1]["status"], rows[-1]["error"], rows[-1]["exit_code"]) == ("failed", line, 1)


def test_read_run_rejects_a_file_that_is_not_a_wandb_log(tmp_path):
    path = tmp_path / "run-x.wandb"
    path.write_bytes(b"not a transaction log")
    with pytest.raises(WandbFileError, match="not a .wandb file"):
        read_run(path)


# -- W&B that cannot start (issue 21) ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["online", "offline", "disabled", "dryrun", "run", "shared", "bogus", ""])
def test_the_modes_check_wandb_accepts_are_wandbs_own(offline_env, mode):
    """check_wandb's list against wandb's own Settings (a wandb that adds or drops a mode fails this)."""
    import wandb

    from hypertrain.config import UserError
    from hypertrain.rundir.wandb_settings import WANDB_LOCAL_MODES, check_wandb

    try:
        wandb.Settings(mode=mode)
        wandb_accepts = True
    except Exception:  # pydantic's ValidationError
        wandb_accepts = False
    offline_env.setenv("WANDB_MODE", mode)
    offline_env.setenv("WANDB_API_KEY", "k" * 40)  # credentials are not what this compares
    try:
        check_wandb(LoggerConfig(name="wandb", project="hypertrain-test"))
        we_accept = True
    except UserError as e:
        assert str(e).startswith(f"WANDB_MODE={mode!r} is not a W&B mode; valid: "), e
        we_accept = False
    assert we_accept == wandb_accepts, (mode, wandb_accepts)
    assert set(WANDB_LOCAL_MODES) <= {"offline", "dryrun", "disabled"}


@pytest.mark.parametrize(
    "project", ["hypertrain", "a" * 128, "a" * 129, "team/speech", "a\\b", "a#b", "a?b", "a%b", "a:b"]
)
def test_the_project_names_check_wandb_refuses_are_the_ones_wandb_refuses(offline_env, project):
    import wandb

    from hypertrain.config import UserError
    from hypertrain.rundir.wandb_settings import check_wandb

    try:
        wandb.Settings(project=project)
        wandb_accepts = True
    except Exception:  # wandb's UsageError
        wandb_accepts = False
    offline_env.setenv("WANDB_MODE", "offline")
    try:
        check_wandb(LoggerConfig(name="wandb", project=project))
        we_accept = True
    except UserError as e:
        assert "\n" not in str(e) and "valid: 1 to 128 characters" in str(e), e
        we_accept = False
    assert we_accept == wandb_accepts, (project, wandb_accepts)


def test_wandb_that_cannot_start_leaves_no_records_and_no_wandb_folder(offline_env, tmp_path):
    """wandb.init failing at run start (here: a mode only the environment gave it, past the entry's
    check): WandbFailed in one line, and neither metrics.jsonl nor the wandb folder is left, so the
    directory is as it was (a new run's, empty)."""
    from hypertrain.failures import WandbFailed

    offline_env.setenv("WANDB_MODE", "bogus")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(WandbFailed) as failed:
        with open_logger(run_dir):
            pytest.fail("the records opened although W&B could not start")
    assert str(failed.value).startswith("W&B could not start (") and "\n" not in str(failed.value)
    assert failed.value.exit_code == 1
    assert list(run_dir.iterdir()) == []


def test_a_resumed_runs_records_stay_when_wandb_cannot_start(offline_env, tmp_path):
    """The records a run already has are not this session's: they stay byte for byte."""
    from hypertrain.failures import WandbFailed

    run_dir = tmp_path / "run"
    with open_logger(run_dir, name="none") as log:
        log.log_update(UPDATES[0])
    before = (run_dir / "metrics.jsonl").read_bytes()
    offline_env.setenv("WANDB_MODE", "bogus")
    with pytest.raises(WandbFailed):
        with open_logger(run_dir):
            pass
    assert (run_dir / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]
