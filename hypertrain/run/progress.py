"""The live status line of a run on a terminal: update, losses, replica-steps/s, ETA."""

from __future__ import annotations

import sys
import time


class Progress:
    """One live status line on a terminal (update, losses, replica-steps/s, ETA); quiet otherwise."""

    def __init__(self, total: int, mode: str):
        self.total, self.start = total, time.perf_counter()
        self.live = mode == "always" or (mode == "auto" and sys.stderr.isatty())
        self.eval_loss: float | None = None
        self.replica_steps = self.done = 0
        self.loss_mean: float | None = None

    def update(self, done: int, loss_mean: float | None, stepped: int) -> None:
        self.replica_steps += stepped
        self.done, self.loss_mean = done, loss_mean
        self._render()

    def _render(self) -> None:
        if not self.live:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        loss = "-" if self.loss_mean is None else f"{self.loss_mean:.4f}"
        held = "-" if self.eval_loss is None else f"{self.eval_loss:.4f}"
        sys.stderr.write(
            f"\rupdate {self.done}/{self.total}  loss {loss}  held-out {held}  "
            f"{self.replica_steps / elapsed:.1f} replica-steps/s  ETA {eta:.0f}s   "
        )
        sys.stderr.flush()

    def close(self) -> None:
        """Show the line once more with the final held-out loss, then end it."""
        if self.live and self.done:
            self._render()
            sys.stderr.write("\n")
