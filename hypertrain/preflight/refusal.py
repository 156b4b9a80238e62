"""A user mistake ends the entry with one line on stderr and exit 2, nothing created: `fail`. Under a
launcher rank 0 prints it; the other ranks wait for the launcher to stop them (`after_rank_0`).
"""

from __future__ import annotations

import os
import sys

from hypertrain.distributed.layouts import launched_rank

# Groups whose `name` field only labels the option chosen; the option is chosen with `group=option`.


def fail(message: str, code: int = 2) -> None:
    """The entry's one line for a mistake (`hypertrain: error: ...`), then exit (2 = a user mistake).
    One of several ranks (torchrun's, srun's) leaves a mistake's line to rank 0 (`after_rank_0`)."""
    launched = launched_rank()
    if code == 2 and launched is not None and launched.rank != 0:
        message = after_rank_0(message, launched.rank)
    print(f"hypertrain: error: {message}", file=sys.stderr)
    sys.exit(code)


# Every rank finds the same mistake after the same work (imports, composition: 0.5 to 3 CPU seconds
# here), started together by the launcher: rank 0 is at most that far behind, several times over on
# a loaded machine. Only a mistake that rank 0 does not see (this machine's own) waits this long.
REFUSAL_GRACE_S = 10.0


def after_rank_0(message: str, rank: int) -> str:
    """A rank other than 0 found a mistake: rank 0 finds it too and prints it once, and its exit makes
    the launcher stop this rank (torchrun's agent: SIGTERM), which then exits 2 without a line. Exiting
    at once instead would make the launcher stop rank 0 before its line. A mistake still unseen by
    rank 0 after REFUSAL_GRACE_S is this rank's own: its line, naming the rank, is returned."""
    import signal
    import time

    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    time.sleep(REFUSAL_GRACE_S)
    return f"rank {rank}: {message}"
