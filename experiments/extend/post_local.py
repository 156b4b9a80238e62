"""Post-local SGD (Lin, Stich, Patel, Jaggi 2020, "Don't Use Large Mini-Batches, Use Local SGD", ICLR,
arXiv:1808.07217, Section 3) as a schedule that lives outside the package: a
`hypertrain.schedule_table.Rounds` entry, named on the command line by its import path
(outer.schedule=post_local.POST_LOCAL; docs/extending.md, "A schedule").

The replicas sync after every one of the phase's first `switch_at` updates (the paper's t': mini-batch
SGD), then after every inner.H updates (local SGD): after counts 1, 2, ..., t', t' + H, t' + 2H, ...,
and at the phase's end. Everything else is the rounds entry's (its run-side class, outer fields and
refusals).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypertrain.errors import UserError
from hypertrain.schedule_table import Rounds


@dataclass(frozen=True)
class PostLocal(Rounds):
    """Rounds of one update up to `switch_at`, then rounds of inner.H."""

    switch_at: int = 0  # t': the updates synced one by one before local SGD starts

    def round_at(self, H: int, u: int) -> tuple[int, int]:
        if u < self.switch_at:
            return u, 1
        return self.switch_at + (u - self.switch_at) // H * H, H

    def check(self, cfg) -> None:
        """The rounds entry's refusals, and what a round of one update cannot hold: fragments and a
        delayed take (each needs a round of several updates); churn (it counts rounds of inner.H)."""
        super().check(cfg)
        outer = cfg.outer
        unbuilt = [
            (outer.fragments > 1, f"outer.fragments={outer.fragments}", "outer.fragments=1"),
            (bool(outer.delay), f"outer.delay={outer.delay}", "outer.delay=0"),
            (cfg.churn.enabled, "churn", "no churn"),
        ]
        for refused, what, valid in unbuilt:
            if refused:
                raise UserError(
                    f"outer.schedule={outer.schedule} with {what} is not built (its first rounds are one "
                    f"update long); valid: {valid}, or outer.schedule=rounds"
                )


POST_LOCAL = PostLocal("post_local", switch_at=2)
