"""How a run that has started can fail, and the exit code each failure leaves with.

Each failure stops the run with one line (`hypertrain: error: run failed: ...`), its metrics.jsonl and
W&B run closed with the line and the code, its checkpoints intact (docs/errors.md). User mistakes are
found before anything runs and exit 2 (`config.UserError`, `plan.PlanError`).
"""

from __future__ import annotations


class RunFailure(RuntimeError):
    """A run that started and could not go on."""

    exit_code = 1


class NonFiniteError(RunFailure):
    """A loss, gradient or held-out loss went non-finite, or a row of metrics.jsonl would hold nan or an
    infinity (JSON has neither): the run stops, never trains on, never writes a row that is not JSON."""

    exit_code = 1


DIVERGED_LINE = "diverged: "  # how the guard's Diverged line begins on rank 0 (diloco/guard.py)


class Diverged(RunFailure):
    """The divergence guard (`guard.*`): at a sync, the held-out loss lies more than guard.heldout_margin
    above the uniform prediction's, or the pseudo-gradient's norm exceeds guard.pseudo_grad_ratio times
    the global weights' norm. The run stops there (exit 1), never trains on."""

    exit_code = 1


class RankFailed(RunFailure):
    """processes=dist: a collective failed or timed out, as another rank died, hung or failed.
    `writer_error`: the self-launch's rank 0 end row's line, where it wrote one."""

    exit_code = 3
    writer_error: str | None = None

    @property
    def diverged(self) -> bool:
        """Whether rank 0 stopped the run on the divergence guard's verdict (its `Diverged` line)."""
        return (self.writer_error or "").startswith(DIVERGED_LINE)


class DiskFull(RunFailure):
    """No space left while writing the run's records or a checkpoint (the previous one is intact)."""

    exit_code = 4


class WandbFailed(RunFailure):
    """W&B could not start the run's W&B run (wandb.init failed: a network error, a server's refusal):
    nothing of a new run is left (its directory as before), so the same command can run again."""

    exit_code = 1


class Terminated(RunFailure):
    """SIGTERM where the run cannot finish its update (a hung rank the launcher stops)."""

    exit_code = 143


EXIT_CODES = {
    0: "the run finished",
    1: "a non-finite loss, gradient or held-out loss, or a row of metrics.jsonl that would hold nan or an "
    "infinity (NonFiniteError), a divergence the guard caught "
    "(Diverged), W&B that could not start "
    "(WandbFailed: nothing of a new run is left), or an unexpected error",
    2: "a user mistake, found before the run started: nothing was created or changed",
    3: "processes=dist: a rank died, hung past processes.timeout_s or failed, or the ranks could not "
    "meet (RankFailed)",
    4: "no space left on the device while writing records or a checkpoint (DiskFull); before the first "
    "record (or under 128 KiB free at the start) nothing of a new run is left",
    129: "stopped by SIGHUP after an update, checkpointed: resume=auto goes on (Preempted, `interrupted`)",
    130: "stopped by SIGINT (Ctrl-C) after an update, checkpointed: resume=auto goes on (Preempted, "
    "`interrupted`); a second Ctrl-C stops at once, the newest checkpoint intact (StoppedAtOnce); before "
    "training started: one line, nothing of a new run left (every stop signal, with its own code)",
    131: "stopped by SIGQUIT (Ctrl-\\\\) after an update, checkpointed, as SIGINT: resume=auto goes on "
    "(Preempted, `interrupted`)",
    143: "stopped by SIGTERM or SIGUSR2 after an update, checkpointed: resume=auto goes on (Preempted)",
}
