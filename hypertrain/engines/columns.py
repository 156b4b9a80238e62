"""The named columns of a round's per-update records, each a float64 tensor whose last axis is
`REPLICA_COLUMNS` (`diloco.rounds.local_table`) or `PROCESS_COLUMNS` (`throughput.process_table`):
written by name (`row`), read by name (`of`), and still one tensor for one gather across processes.
"""

from __future__ import annotations

from torch import Tensor

from hypertrain.model.spec import MODEL_COLUMNS


class Columns:
    """The names of a record's last axis, in order."""

    def __init__(self, *names: str):
        assert len(set(names)) == len(names), f"a column is named twice: {names}"
        self.names = names

    def __len__(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int:
        """Where column `name` sits on the last axis (for an in-place write across several axes)."""
        if name not in self.names:
            raise KeyError(f"{name!r} is not a column; valid: {', '.join(self.names)}")
        return self.names.index(name)

    def of(self, table: Tensor, name: str) -> Tensor:
        """`table`'s column `name`, over all its leading axes."""
        return table[..., self.index(name)]

    def row(self, **values: float) -> list[float]:
        """One row in column order from every column's value, each named once."""
        assert values.keys() == set(self.names), f"a row needs {self.names}, got {tuple(values)}"
        return [values[name] for name in self.names]


# A replica's update: whether it stepped (1) or not (0: churn kept it out; its figures are then NaN, a
# float tensor's filler, never read: `Segment.stepped` and `Segment.losses` are what is read, None for a
# replica that did not step), its loss, its targets, its microbatches (the most of its ranks' shares),
# then the columns the model table's entries add (`model.spec`: for multistream the text channel's token
# mean and the audio channels' mean, for a mixture of experts its load-balancing loss and the smallest
# and largest fraction of routing slots an expert got; NaN for a model without them).
REPLICA_COLUMNS = Columns("stepped", "loss", "targets", "microbatches", *MODEL_COLUMNS)

# A process's update, its replicas' (or rank's) shares summed: examples, supervised target tokens,
# padded target positions (rows x width: what the model computed; times the channels for multistream),
# wall seconds of the update (forward, backward, gradient all-reduce, step) and of its gradient
# all-reduce alone, positions read (frames for multistream, tokens otherwise). A weak phase presents
# its base streams W/B times; each presentation counts as an example, as the seed says ("explicitly
# counted as presentations").
PROCESS_COLUMNS = Columns("samples", "tokens", "padded", "seconds", "allreduce_seconds", "frames")
