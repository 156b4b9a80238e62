"""What every schedule of the train loop (`trainer.Rounds`, `asynchronous.Arrivals`) is built from: the
run, its state, the process groups, the checkpointer, the stop callback and the held-out loss and sources
so far; `rows(progress, throughput, start)` yields its rows and `summary()` gives its part of the summary.
"""

from __future__ import annotations

from hypertrain.diloco.state import PreparedRun, RunState
from hypertrain.distributed.groups import Collectives


class ScheduleBase:
    def __init__(
        self,
        run: PreparedRun,
        state: RunState,
        groups: Collectives,
        checkpointer,
        on_stop,
        eval_loss,
        sources,
    ):
        self.run, self.state, self.groups, self.checkpointer = run, state, groups, checkpointer
        self.on_stop, self.eval_loss, self.sources = on_stop, eval_loss, sources
