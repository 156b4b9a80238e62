"""The sample plan: which stream ids every replica and rank sees at every update (numpy only).

A pure, deterministic function of (phase, update, rank, world, replicas, samples), as docs/design.md
("The sample plan") defines it and docs/plan.md lists it. Id functions return no ids past the end of
the stream; user mistakes raise `PlanError`, one line.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

_HASH_CHUNK = 1 << 19  # int64s hashed per numpy block (4 MiB): bounded memory, no Python object per id
# The largest world (ranks) the plan takes: its checks, digests and views go over every rank, so a
# world beyond any machine would make them run for hours; refused with one line instead.
MAX_WORLD = 1 << 16


class PlanError(ValueError):
    """A user mistake in a phase, a world or a batch; the message is one line: value and what is valid."""


def _integer(name: str, value, low: int | None = None) -> int:
    if type(value) is not int:  # plain ints skip the (slow) abstract-class check
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise PlanError(f"{name}={value!r} is not an integer; valid: an integer >= {low or 0}")
        value = int(value)
    if low is not None and value < low:
        raise PlanError(f"{name}={value} is too small; valid: an integer >= {low}")
    return value


class _PhaseFields:
    """Shared validation: every field is an int (numpy ints are converted), the name is a string."""

    def _validate(self, lows: dict[str, int]) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise PlanError(f"phase name={self.name!r} is not valid; valid: a non-empty string")
        for field_name, low in lows.items():
            value = _integer(f"phase {self.name}: {field_name}", getattr(self, field_name), low)
            object.__setattr__(self, field_name, value)
        if self.timing_warmup > self.updates:
            raise PlanError(
                f"phase {self.name}: timing_warmup={self.timing_warmup} exceeds updates={self.updates}; "
                f"valid: 0..{self.updates}"
            )


@dataclass(frozen=True)
class StrongPhase(_PhaseFields):
    """Strong scaling: every update takes the next `global_batch` ids, whatever the world."""

    name: str
    offset: int
    global_batch: int
    updates: int
    timing_warmup: int = 0

    def __post_init__(self) -> None:
        self._validate({"offset": 0, "global_batch": 1, "updates": 1, "timing_warmup": 0})

    @property
    def update_size(self) -> int:
        return self.global_batch


@dataclass(frozen=True)
class WeakPhase(_PhaseFields):
    """Weak scaling: B*b ids per update, the B base streams presented W/B times at world W."""

    name: str
    offset: int
    base_world: int
    per_rank_batch: int
    updates: int
    timing_warmup: int = 0

    def __post_init__(self) -> None:
        lows = {"offset": 0, "base_world": 1, "per_rank_batch": 1, "updates": 1, "timing_warmup": 0}
        self._validate(lows)

    @property
    def update_size(self) -> int:
        return self.base_world * self.per_rank_batch


Phase = StrongPhase | WeakPhase

# The seed's benchmark phases (world 8 and 16), then phases small enough for a CPU (world 2 and 4).
PRESETS: dict[str, Phase] = {
    "strong": StrongPhase("strong", offset=0, global_batch=256, updates=40, timing_warmup=10),
    "weak": WeakPhase("weak", offset=10240, base_world=8, per_rank_batch=32, updates=12, timing_warmup=4),
    "cpu_strong": StrongPhase("cpu_strong", offset=0, global_batch=64, updates=40, timing_warmup=10),
    "cpu_weak": WeakPhase(
        "cpu_weak", offset=2560, base_world=2, per_rank_batch=32, updates=12, timing_warmup=4
    ),
    "smoke": StrongPhase("smoke", offset=0, global_batch=32, updates=6, timing_warmup=1),
}


def preset(name: str) -> Phase:
    """The preset phase called `name`."""
    if name not in PRESETS:
        raise PlanError(f"phase={name!r} is not a preset; valid: {', '.join(map(repr, PRESETS))}")
    return PRESETS[name]


def benchmark_phases(world: int) -> list[Phase]:
    """The seed's phases for world 8 or 16: strong G 256 x 40, then weak B 8, b 32 x 12 at id 10240."""
    if world not in (8, 16):
        raise PlanError(f"world={world!r} has no benchmark phases; valid: 8, 16 (cpu_phases: 2, 4)")
    return [PRESETS["strong"], PRESETS["weak"]]


def cpu_phases(world: int) -> list[Phase]:
    """CPU-sized phases for world 2 or 4: strong G 64 x 40, then weak B 2, b 32 x 12 at id 2560."""
    if world not in (2, 4):
        raise PlanError(f"world={world!r} has no CPU phases; valid: 2, 4")
    return [PRESETS["cpu_strong"], PRESETS["cpu_weak"]]


def _check_phase(phase) -> None:
    if not isinstance(phase, StrongPhase | WeakPhase):
        raise PlanError(f"phase={phase!r} is not a phase; valid: a StrongPhase or a WeakPhase")


def _check_replicas(phase: Phase, replicas: int) -> int:
    replicas = _integer("replicas", replicas, 1)
    if isinstance(phase, WeakPhase) and phase.base_world % replicas:
        raise PlanError(
            f"replicas={replicas} does not divide the weak phase's base_world={phase.base_world}; "
            f"valid: a divisor of {phase.base_world}"
        )
    return replicas


def _check_world(phase: Phase, world: int, replicas: int) -> tuple[int, int]:
    world = _integer("world", world, 1)
    if world > MAX_WORLD:
        raise PlanError(f"world={world} is too large; valid: an integer 1..{MAX_WORLD}")
    replicas = _check_replicas(phase, replicas)
    if world % replicas:
        raise PlanError(f"replicas={replicas} does not divide world={world}; valid: a divisor of {world}")
    return world, replicas


def _in_range(name: str, value, count: int, what: str) -> int:
    value = _integer(name, value, 0)
    if value >= count:
        raise PlanError(f"{name}={value} is out of range; valid: 0..{count - 1} ({what})")
    return value


def _update_bounds(phase: Phase, update: int, samples: int) -> tuple[int, int]:
    """[start, stop) of update `update`'s ids; start == stop past the end of the stream."""
    _check_phase(phase)
    update = _integer("update", update, 0)
    samples = _integer("samples", samples, 0)
    start = phase.offset + update * phase.update_size
    stop = min(samples, start + phase.update_size)
    return start, max(start, stop)


def _rank_first_stride(phase: Phase, rank: int, world: int, replicas: int) -> tuple[int, int]:
    """Rank r takes U[first::stride]; from V_m[j::L] (strong) or V_m[(j mod L_B)::L_B] (weak)."""
    local_ranks = world // replicas
    replica, local = divmod(rank, local_ranks)
    if isinstance(phase, WeakPhase):
        base_streams = phase.base_world // replicas
        return replica + replicas * (local % base_streams), phase.base_world
    return replica + replicas * local, world


def update_ids(phase: Phase, update: int, samples: int) -> np.ndarray:
    """U: the ids of update `update` (int64, increasing); the tail is kept, nothing past `samples`."""
    start, stop = _update_bounds(phase, update, samples)
    return np.arange(start, stop, dtype=np.int64)


def replica_ids(phase: Phase, update: int, replica: int, replicas: int, samples: int) -> np.ndarray:
    """V_m = U[m::R]: replica m's ids of the update, in increasing order; independent of the world."""
    start, stop = _update_bounds(phase, update, samples)
    replicas = _check_replicas(phase, replicas)
    replica = _in_range("replica", replica, replicas, f"replicas={replicas}")
    return np.arange(start + replica, stop, replicas, dtype=np.int64)


def rank_ids(phase: Phase, update: int, rank: int, world: int, replicas: int, samples: int) -> np.ndarray:
    """The ids rank `rank` presents at the update; replica m is ranks m*L .. m*L+L-1, L = world/R."""
    start, stop = _update_bounds(phase, update, samples)
    world, replicas = _check_world(phase, world, replicas)
    rank = _in_range("rank", rank, world, f"world={world}")
    first, stride = _rank_first_stride(phase, rank, world, replicas)
    return np.arange(start + first, stop, stride, dtype=np.int64)


def _from_seed_dict(phase: Mapping, world: int) -> Phase:
    """A phase from the seed's dict (name, offset, global_batch, updates, warmup[, replicated_base_world])."""
    name, warmup = phase.get("name", "phase"), phase.get("warmup", 0)
    if phase.get("replicated_base_world"):
        per_rank = phase["global_batch"] // _integer("world", world, 1)
        base = phase["replicated_base_world"]
        return WeakPhase(name, phase["offset"], base, per_rank, phase["updates"], warmup)
    return StrongPhase(name, phase["offset"], phase["global_batch"], phase["updates"], warmup)


def step_indices(phase: Phase | Mapping, step: int, rank: int, world: int, samples: int) -> list[int]:
    """The seed's signature and results (R = 1); also takes the seed's phase dicts."""
    if isinstance(phase, Mapping):
        phase = _from_seed_dict(phase, world)
    return rank_ids(phase, step, rank, world, 1, samples).tolist()


def updates_run(phase: Phase, samples: int) -> int:
    """How many leading updates of the phase have any ids; the rest are past the end and not run."""
    _check_phase(phase)
    remaining = _integer("samples", samples, 0) - phase.offset
    return max(0, min(phase.updates, -(-remaining // phase.update_size)))


def validate_run(phase: Phase, world: int, replicas: int, samples: int) -> None:
    """Raise PlanError unless `phase` can run at this world, replica count and stream length."""
    _check_phase(phase)
    world, replicas = _check_world(phase, world, replicas)
    samples = _integer("samples", samples, 1)
    if isinstance(phase, WeakPhase) and world % phase.base_world:
        raise PlanError(
            f"world={world} is not a multiple of the weak phase's base_world={phase.base_world}; "
            f"valid: k*{phase.base_world}"
        )
    if phase.offset >= samples:
        raise PlanError(
            f"phase {phase.name}: offset={phase.offset} is beyond the stream of samples={samples} ids; "
            f"valid: offset < {samples}"
        )


# ---------------------------------------------------------------------------------------- microbatches


def fixed_microbatches(n_rows: int, micro_batch: int) -> list[np.ndarray]:
    """Row indices 0..n_rows-1 in order, in chunks of at most `micro_batch` rows (0 = one chunk)."""
    n_rows = _integer("n_rows", n_rows, 0)
    micro_batch = _integer("micro_batch", micro_batch, 0)
    rows = np.arange(n_rows, dtype=np.int64)
    if n_rows == 0:
        return []
    return [rows] if micro_batch == 0 else np.split(rows, range(micro_batch, n_rows, micro_batch))


def length_microbatches(lengths, max_padded_tokens: int, max_examples: int) -> list[np.ndarray]:
    """The seed's rule as index groups: stable length sort, then greedy under both bounds.

    A group grows while (its rows + 1) * the new longest length <= max_padded_tokens and it has fewer
    than max_examples rows.
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
        raise PlanError(f"lengths of shape {lengths.shape} and dtype {lengths.dtype}; valid: 1-d integers")
    max_padded_tokens = _integer("max_padded_tokens", max_padded_tokens, 1)
    max_examples = _integer("max_examples", max_examples, 1)
    if lengths.size == 0:
        return []
    if lengths.min() < 0:
        raise PlanError(f"length={int(lengths.min())} is negative; valid: lengths >= 0")
    if lengths.max() > max_padded_tokens:
        raise PlanError(
            f"max_padded_tokens={max_padded_tokens} is smaller than the longest example "
            f"({int(lengths.max())} tokens); valid: >= {int(lengths.max())}"
        )
    order = np.argsort(lengths, kind="stable")
    cuts, rows = [], 0
    for position, n in enumerate(lengths[order].tolist()):
        if rows and (n * (rows + 1) > max_padded_tokens or rows >= max_examples):
            cuts.append(position)
            rows = 0
        rows += 1
    return np.split(order.astype(np.int64), cuts)


def microbatches(examples: Sequence[Mapping], max_padded_tokens: int = 12000, max_examples: int = 16):
    """The seed's `microbatches` on dicts with 'input_ids' (lists of examples, length-sorted)."""
    lengths = np.array([len(example["input_ids"]) for example in examples], dtype=np.int64)
    groups = length_microbatches(lengths, max_padded_tokens, max_examples)
    return [[examples[i] for i in group.tolist()] for group in groups]


# ------------------------------------------------------------------------------------- channel weights


def _channel_fractions(local_counts, global_counts, scales, world):
    local = np.asarray(local_counts, dtype=np.float64)
    total = np.asarray(global_counts, dtype=np.float64)
    scale = np.asarray(scales, dtype=np.float64)
    world = _integer("world", world, 1)
    if total.ndim != 1 or scale.shape != total.shape or local.shape[-1:] != total.shape:
        raise PlanError(
            f"channel shapes local={local.shape} global={total.shape} scales={scale.shape}; "
            "valid: global and scales (C,), local (..., C)"
        )
    if not (np.all(np.isfinite(scale)) and np.all(scale > 0)):
        raise PlanError(f"scales={scale.tolist()} are not all positive; valid: finite scales > 0")
    if np.any(local < 0) or np.any(local > total):
        raise PlanError(
            f"local counts {local.tolist()} are not within 0..global counts {total.tolist()}; "
            "valid: a share of the replica's totals"
        )
    active = total > 0
    normaliser = float(scale[active].sum())
    fraction = np.divide(
        local, total, out=np.zeros(np.broadcast_shapes(local.shape, total.shape)), where=active
    )
    return fraction * scale, normaliser, world


def channel_weights(local_counts, global_counts, scales, world: int) -> tuple[np.ndarray, float]:
    """The seed's `dynamic_weights`, any channels: weights w_c = world*k_c*local_c/global_c and a scale.

    A loss normalised by sum(w) and multiplied by the scale, then averaged over `world` ranks (DDP)
    and summed over microbatches, is sum_c k_c*mean_c / sum_{c active} k_c on the replica's batch.
    Channels without tokens here weigh 0; channels without tokens in the batch leave the normaliser.
    """
    scaled_fraction, normaliser, world = _channel_fractions(local_counts, global_counts, scales, world)
    weights = world * scaled_fraction
    if normaliser == 0:
        return weights, 0.0
    scale = weights.sum(axis=-1) / normaliser
    return weights, (float(scale) if np.ndim(scale) == 0 else scale)


def channel_coefficients(local_counts, global_counts, scales, world: int = 1) -> np.ndarray:
    """Per-channel factors c_c for the local channel means: sum_c c_c * local_mean_c, summed over
    microbatches and averaged over `world` ranks, is sum_c k_c*global_mean_c / sum_{c active} k_c.

    Zero where a channel has no local tokens (leave that mean out: it is undefined); never NaN.
    """
    scaled_fraction, normaliser, world = _channel_fractions(local_counts, global_counts, scales, world)
    if normaliser == 0:
        return np.zeros_like(scaled_fraction)
    return world * scaled_fraction / normaliser


def dynamic_weights(local_frames, local_samples, global_frames, global_samples, world):
    """The seed's `dynamic_weights`: text (frames + samples, k 1) and 12 codebooks (frames, k 32/12)."""
    local = [local_frames + local_samples] + [local_frames] * 12
    total = [global_frames + global_samples] + [global_frames] * 12
    weights, scale = channel_weights(local, total, [1.0] + [32.0 / 12] * 12, world)
    return weights.tolist(), float(scale)


# ----------------------------------------------------------------------------------------------- hashes


def _hash_range(digest, start: int, stop: int) -> None:
    for low in range(start, stop, _HASH_CHUNK):
        digest.update(np.arange(low, min(stop, low + _HASH_CHUNK), dtype="<i8"))


def union_sha256(phase: Phase, samples: int, world: int | None = None) -> str:
    """sha256 of the phase's ids, sorted, each once, as little-endian int64 (the seed's union hash).

    The union is [offset, min(samples, offset + updates*size)) at every valid world; a given world is
    validated against the phase.
    """
    if world is not None:
        validate_run(phase, world, 1, samples)
    start, _ = _update_bounds(phase, 0, samples)
    _, stop = _update_bounds(phase, max(0, updates_run(phase, samples) - 1), samples)
    digest = hashlib.sha256()
    _hash_range(digest, start, stop)
    return digest.hexdigest()


def _ordered_digest(phase: Phase, samples: int, groups: list[tuple[int, int]]) -> str:
    """sha256 over every run update in order, each group (first, stride) in order: count, then ids.

    Updates of equal size share one layout shifted by their start, so whole blocks of updates are
    written as one int64 array: no Python object per id.
    """
    digest = hashlib.sha256()
    size = phase.update_size
    count = updates_run(phase, samples)

    def layout(n: int) -> tuple[np.ndarray, np.ndarray]:
        parts, is_id = [], []
        for first, stride in groups:
            positions = np.arange(first, n, stride, dtype=np.int64)
            parts += [np.array([positions.size], dtype=np.int64), positions]
            is_id += [np.zeros(1, dtype=np.int64), np.ones(positions.size, dtype=np.int64)]
        return np.concatenate(parts), np.concatenate(is_id)

    if count == 0:
        return digest.hexdigest()
    tail_start, tail_stop = _update_bounds(phase, count - 1, samples)
    full = count if tail_stop - tail_start == size else count - 1
    values, is_id = layout(size)
    block = max(1, _HASH_CHUNK // values.size)
    for first_update in range(0, full, block):
        updates = np.arange(first_update, min(full, first_update + block), dtype=np.int64)
        rows = np.multiply.outer(phase.offset + updates * size, is_id)
        rows += values
        digest.update(rows.astype("<i8", copy=False))
    if full < count:  # the tail update is shorter: its own layout
        values, is_id = layout(tail_stop - tail_start)
        digest.update((values + tail_start * is_id).astype("<i8", copy=False).tobytes())
    return digest.hexdigest()


def data_order_digest(phase: Phase, replicas: int, samples: int) -> str:
    """sha256 over run updates in order, replicas in order: len(V_m) then V_m (little-endian int64)."""
    _check_phase(phase)
    replicas = _check_replicas(phase, replicas)
    return _ordered_digest(phase, samples, [(m, replicas) for m in range(replicas)])


def rank_digest(phase: Phase, world: int, replicas: int, samples: int) -> str:
    """The data-order digest over ranks instead of replicas; it changes with the world."""
    _check_phase(phase)
    world, replicas = _check_world(phase, world, replicas)
    return _ordered_digest(
        phase, samples, [_rank_first_stride(phase, r, world, replicas) for r in range(world)]
    )
