"""The sample plan: which ids each update, replica and rank trains on (numpy only, no torch).

`from hypertrain import plan` gives its public API: the phases (`sampling`), the seed's check and the
`show` view (`check`); `python -m hypertrain.plan check|show` is its command line.
"""

from hypertrain.plan.check import PlanCheckFailed, check_plan, show, verify_phase
from hypertrain.plan.sampling import (
    MAX_WORLD,
    PRESETS,
    Phase,
    PlanError,
    StrongPhase,
    WeakPhase,
    benchmark_phases,
    channel_coefficients,
    channel_weights,
    cpu_phases,
    data_order_digest,
    dynamic_weights,
    fixed_microbatches,
    length_microbatches,
    microbatches,
    preset,
    rank_digest,
    rank_ids,
    replica_ids,
    step_indices,
    union_sha256,
    update_ids,
    updates_run,
    validate_run,
)

__all__ = [
    "MAX_WORLD",
    "PRESETS",
    "Phase",
    "PlanCheckFailed",
    "PlanError",
    "StrongPhase",
    "WeakPhase",
    "benchmark_phases",
    "channel_coefficients",
    "channel_weights",
    "check_plan",
    "cpu_phases",
    "data_order_digest",
    "dynamic_weights",
    "fixed_microbatches",
    "length_microbatches",
    "microbatches",
    "preset",
    "rank_digest",
    "rank_ids",
    "replica_ids",
    "show",
    "step_indices",
    "union_sha256",
    "update_ids",
    "updates_run",
    "validate_run",
    "verify_phase",
]
