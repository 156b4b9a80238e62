"""The live status line of a run on a terminal (tqdm on stderr): update, training and held-out loss,
replica-steps/s, ETA. `logger.progress`: `always`, `never`, or `auto` (only when stderr is a terminal).
"""

from __future__ import annotations

import sys
import threading

from tqdm import tqdm


class _Bar(tqdm):
    """tqdm with a thread lock only: tqdm's default lock is a multiprocessing semaphore, which a
    process killed in its teardown (a rank of processes=dist) leaves for the resource tracker to warn of."""

    _lock = threading.RLock()


class Progress:
    """The writer's status line over the phase's updates; writes nothing when it is not live."""

    def __init__(self, total: int, mode: str, done: int = 0):
        """`done`: the updates a resumed run had finished already (not counted in its rates)."""
        live = mode == "always" or (mode == "auto" and sys.stderr.isatty())
        self.eval_loss: float | None = None
        self.replica_steps = 0  # this session's, for its rate
        self.loss_mean: float | None = None
        self.bar = _Bar(
            total=total,
            initial=done,
            disable=not live,
            file=sys.stderr,
            dynamic_ncols=True,
            bar_format="update {n_fmt}/{total_fmt}{postfix}  ETA {remaining}",
        )

    def update(self, done: int, loss_mean: float | None, stepped: int) -> None:
        """Update `done` (1-based) finished with the replicas' mean loss and `stepped` replica steps."""
        self.replica_steps += stepped
        self.loss_mean = loss_mean
        self._postfix()
        self.bar.update(done - self.bar.n)

    def _postfix(self) -> None:
        if self.bar.disable:
            return
        loss = "-" if self.loss_mean is None else f"{self.loss_mean:.4f}"
        held = "-" if self.eval_loss is None else f"{self.eval_loss:.4f}"
        elapsed = self.bar.format_dict["elapsed"]
        rate = self.replica_steps / elapsed if elapsed > 0 else 0.0
        self.bar.set_postfix_str(f"loss {loss}  held-out {held}  {rate:.1f} replica-steps/s", refresh=False)

    def close(self) -> None:
        """Show the line once more with the final held-out loss, then end it."""
        self._postfix()
        self.bar.close()
