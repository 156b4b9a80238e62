"""The memory a run needs, estimated from its config before anything is allocated, against the
memory this machine has: a run that cannot fit is refused with one line instead of an allocator's
traceback or the kernel's OOM kill after its directory was made.

`estimate(cfg, longest, decided)` is a pure function of a validated config and what it decides (the
layout and device, `distributed.decided`; and, once the data is built, its longest example): the
bytes each process of the run holds at its peak on its compute device and on the host, and how many
processes run on this machine. It costs time in proportion to the config,
never to a size in it: the parameters are counted from the shapes of one layer times the layers,
nothing is allocated. `check(cfg, longest)` refuses (`UserError`, one line naming the sizes, the
estimate, its parts and the memory available) a run whose estimate exceeds `HEADROOM` of what
`host_available` (or, on a GPU, `torch.cuda.mem_get_info`) reports; `guard.memory_check=false`
skips that comparison, never the refusal of a tensor beyond what torch can index. The estimate is
an honest upper-ish bound: each factor is derived below from the code that allocates it, and
tests/test_memory.py holds it against torch's real allocations and a run's measured peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from hypertrain.choices import Transform
from hypertrain.config import HELDOUT_ROWS_PER_PASS, INT64_MAX, ModelConfig, TrainConfig, UserError
from hypertrain.data import data_source
from hypertrain.distributed.decided import Decided, decide
from hypertrain.distributed.layouts import launched_rank
from hypertrain.engines import replicas_at_once
from hypertrain.model.shapes import ROLES, param_specs
from hypertrain.model.spec import model_spec
from hypertrain.optim.outer import outer_optimizer
from hypertrain.preflight.codec_memory import codec_bytes

FLOAT_BYTES = 4  # weights, gradients, optimizer state and activations are fp32 (model.compute_dtype)
ID_BYTES = 8  # token ids are int64 tensors (batches.Microbatch)
# A process's own memory before any tensor of the run: the entry's peak for `experiment=quick
# logger=none` (tensors of a few MB) measured 346 MB (233 MB after importing torch, Hydra and
# hypertrain, 286 MB with the embedded stdlib corpus), rounded up; W&B's service is in HEADROOM.
RUNTIME_BYTES = 400 * 10**6
# A run may plan for this share of the memory available: the rest is for what the estimate leaves
# out (W&B's service process, the allocator's fragmentation, the page cache of data and checkpoints).
HEADROOM = 0.9
MEMINFO = Path("/proc/meminfo")
CGROUP_V2 = Path("/sys/fs/cgroup")  # memory.max ("max": no limit) and memory.current
CGROUP_V1 = Path("/sys/fs/cgroup/memory")  # memory.limit_in_bytes and memory.usage_in_bytes
NO_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63


@dataclass(frozen=True)
class Estimate:
    """Bytes of the run's parts, per process of the run (a worker) unless said otherwise."""

    params: int  # one replica's parameters
    weights: int  # their bytes
    rank_weights: int  # the bytes of them a worker holds: all, or a sharded replica's rank 0's shards
    state: int  # on the device: weights, gradients, optimizer state, the step's temporaries
    activations: int  # on the device: one microbatch's forward and backward (or a held-out pass)
    codec: int  # on the device: a block codec's sync of every replica (`codec_memory.codec_bytes`)
    batches: int  # on the host: a round's token ids, and the held-out ones
    checkpoint: int  # on the host, once for the machine: the copies a checkpoint makes
    workers: int  # processes on this machine that train (each holds state, activations, batches)
    entry: int  # a self-launching entry that waits for its workers (holds the runtime only)
    replicas: int  # per worker
    stacked: int  # replicas one forward and backward computes at once
    rows: int  # one replica's rows in a microbatch
    positions: int  # one replica's positions (rows x the tokens each reads) in a microbatch
    largest: tuple[str, int]  # the tensor with the most elements: what it is, its elements

    @property
    def device(self) -> int:
        """One worker's bytes on its compute device."""
        return self.state + self.activations + self.codec

    def host(self, on_gpu: bool) -> int:
        """The machine's host bytes: every process's runtime and batches, the checkpoint's copies,
        and on a CPU the workers' device bytes as well."""
        per_worker = RUNTIME_BYTES + self.batches + (0 if on_gpu else self.device)
        return self.workers * per_worker + self.entry * RUNTIME_BYTES + self.checkpoint


def model_with_vocabs(cfg: TrainConfig) -> ModelConfig:
    """The model config with a multistream model's channel vocabularies as the data will fill them
    in (speech: the text vocabulary, then one codebook's per audio channel; trainer.model_for_data)."""
    m, d = cfg.model, cfg.data
    channels = model_spec(m).channels
    if not channels and m.vocab == 0:  # the data's: a prepared corpus's meta says it
        return replace(m, vocab=data_source(d).vocab(d))
    if not channels or m.channel_vocabs:
        return m
    # [m.vocab] for data of one channel: refused by the trainer
    return replace(m, channel_vocabs=data_source(d).channel_vocabs(d) or [m.vocab])


def _counts_by_role(model: ModelConfig, shards: int) -> dict[str, int]:
    counts = dict.fromkeys(ROLES, 0)
    for shape, role in param_specs(model).values():
        counts[role] += math.ceil(shape[0] / shards) * math.prod(shape[1:]) if shape else 1
    return counts


def params_by_role(model: ModelConfig, shards: int = 1) -> dict[str, int]:
    """One replica's parameters per role (`model.ROLES`), from the shapes of the model without
    layers and with one: the layers are alike, so `n_layers` is a factor, never a loop. `shards`: L of
    a sharded replica, whose rank 0 holds the first of each parameter's L dim-0 chunks, ceil(dim 0 / L)
    rows (FSDP2 cuts as `torch.chunk` does; its first chunks are the longest)."""
    base = _counts_by_role(replace(model, n_layers=0), shards)
    one = _counts_by_role(replace(model, n_layers=1), shards)
    return {role: base[role] + model.n_layers * (one[role] - base[role]) for role in ROLES}


def gathered_bytes(model: ModelConfig) -> int:
    """What FSDP2 holds whole beside a sharded replica's shards at its peak (fsdp_engine: one unit per
    block, then the root): the root's weights (gathered for the forward and kept until the backward,
    FSDP2's root is not resharded after its forward), a block's and the next one's (prefetched), and the
    larger unit's whole gradient before its reduce-scatter."""
    root = sum(params_by_role(replace(model, n_layers=0)).values())
    block = sum(params_by_role(replace(model, n_layers=1)).values()) - root
    return (root + 2 * block + max(root, block)) * FLOAT_BYTES


def ids_per_update(cfg: TrainConfig) -> int:
    """The ids of one update: strong G; weak B * b (docs/design.md, "Update u's ids")."""
    p = cfg.phase
    return p.global_batch if p.kind == "strong" else p.base_world * p.per_rank_batch


def processes(cfg: TrainConfig, decided: Decided) -> tuple[int, int, int, int]:
    """(workers on this machine, self-launching entries, replicas per worker, the plan's streams a
    worker's share is cut into): processes=dist runs the decided layout's P processes, R/P replicas
    each under the replicas layout, one replica's share of L ranks under the benchmark layout
    (distributed.layouts); under a launcher only this node's processes are on this machine."""
    layout = decided.layout
    if layout is None:
        return 1, 0, cfg.replicas, 1
    P = layout.processes
    launched = launched_rank()
    workers, entry = (P, 1) if launched is None else (launched.local_processes, 0)
    if layout.kind == "replicas":
        return workers, entry, cfg.replicas // P, 1
    # A weak phase at W = kB presents each id on k of a replica's L ranks (data.batches.rank_streams).
    repeats = cfg.world.size // cfg.phase.base_world if cfg.phase.kind == "weak" else 1
    return workers, entry, 1, max(1, layout.ranks_per_replica // repeats)


def row_ids(cfg: TrainConfig, longest: int | None) -> int:
    """Ids in the longest row: the data's longest example once built, else the longest the config
    allows (windows seq_len + 1, documents max_len + 1); speech utterances have no bound in the
    config, so before the data is built they count as the shortest example (2 ids) and the check
    after the build (`longest` given) covers their batches and activations."""
    if longest is not None:
        return longest
    bound = data_source(cfg.data).longest(cfg.data)
    return 2 if bound is None else bound


def microbatch(cfg: TrainConfig, share: int, row: int, micro_batch: int) -> tuple[int, int]:
    """(rows, positions) of one replica's largest microbatch of `share` ids whose rows hold at most
    `row` ids: windows in chunks of `micro_batch` rows (0 = all); variable-length examples grouped
    under data.max_padded_tokens and data.max_examples (plan.length_microbatches; an example longer
    than the bound is a microbatch of its own)."""
    if not data_source(cfg.data).variable_length(cfg.data):
        rows = min(micro_batch or share, share)
        return rows, rows * (row - 1)
    rows = min(cfg.data.max_examples, share)
    return rows, min(max(cfg.data.max_padded_tokens, row), rows * row)


def activation_floats(model: ModelConfig) -> tuple[int, int]:
    """(floats per position a training microbatch holds, floats per position of a forward-only
    held-out pass): the model entry's (`model.spec`), counted from its forward."""
    return model_spec(model).activation_floats(model)


def weight_bytes(cfg: TrainConfig, by_role: dict[str, int]) -> tuple[int, int, int]:
    """(W, A, M): one replica's weights in bytes, the part AdamW steps (it has a second moment) and
    the part Muon steps (the hidden matrices under inner=muon; optim.uses_muon)."""
    W = sum(by_role.values()) * FLOAT_BYTES
    M = by_role["hidden"] * FLOAT_BYTES if cfg.inner.name == "muon" else 0
    return W, W - M, M


def outer_state_bytes(cfg: TrainConfig, by_role: dict[str, int]) -> int:
    """The outer optimizer's state for the whole model, in bytes: what it declares per parameter (the
    built-in's momentum, 4; delayed Nesterov's momentum and buffer, 8; a torch optimizer's, measured:
    `optim.outer`) times the parameters, rounded up."""
    return math.ceil(outer_optimizer(cfg.outer).state_bytes(cfg.outer) * sum(by_role.values()))


def model_state_bytes(cfg: TrainConfig, by_role: dict[str, int], replicas: int, stacked: int) -> int:
    """One worker's weights, gradients and optimizer state at the peak of a round, in bytes, counted
    from the trainer and the engines (W: one replica's weights, A: the AdamW-handled part, which has
    a second moment, M: the Muon-handled hidden matrices, S: the outer optimizer's state,
    `outer_state_bytes`):

    - the global weights and the outer optimizer's state: W + S (run_state.RunState), and under
      outer.overlap=eager per local replica its own outer weights and state: W + S;
    - per local replica its kept inner state, m for every parameter and v for AdamW's: W + A, and
      the weights and state the engine hands back, held until the sync: 2 W + A;
    - per stacked replica its weights and gradients (2 W) and the stacked copy of its state (W + A),
      and the inner step's temporaries (optim.inner_step): the clipped gradients (W), AdamW's
      denominator and update (2 A), Muon's look-ahead, stacked group and Newton-Schulz iterates
      (4 M); under bf16 autocast the weights' bf16 copy (W / 2).
    The loop engine (stacked = 1) holds one replica's at a time.
    """
    W, A, M = weight_bytes(cfg, by_role)
    S = outer_state_bytes(cfg, by_role)
    bf16_copy = W // 2 if cfg.model.compute_dtype == "bf16" else 0
    per_stacked = 2 * W + (W + A) + (W + 2 * A + 4 * M) + bf16_copy
    outer = (W + S) * (1 + (replicas if cfg.outer.overlap == "eager" else 0))
    return outer + replicas * ((W + A) + (2 * W + A)) + stacked * per_stacked


def checkpoint_bytes(
    cfg: TrainConfig, decided: Decided, by_role: dict[str, int], replicas: int, workers: int
) -> int:
    """Host copies a checkpoint makes (checkpoint.Checkpointer.save): several processes pickle every
    replica's state, and mid-round its weights, to rank 0 (each sent and received: 2 x R (2 W + A));
    one process on a GPU copies its state to the host (W + S: the global weights and the outer optimizer's
    state, `outer_state_bytes`; its replicas' 2 W + A); on a CPU, none."""
    W, A, _ = weight_bytes(cfg, by_role)
    if cfg.processes.name == "dist" and workers > 1:
        return 2 * cfg.replicas * (2 * W + A)
    S = outer_state_bytes(cfg, by_role)
    return W + S + replicas * (2 * W + A) if decided.device.startswith("cuda") else 0


def largest_tensor(model: ModelConfig, stacked: int, positions: int) -> tuple[str, int]:
    """The tensor with the most elements: a parameter stacked over the replicas computed at once, or
    the logits of one stacked microbatch (one channel's head at a time)."""
    vocabs = model_spec(model).vocabs(model)
    specs = param_specs(replace(model, n_layers=min(model.n_layers, 1)))
    name, (shape, _) = max(specs.items(), key=lambda item: math.prod(item[1][0]))
    return max(
        (f"parameter {name} x {stacked} stacked replicas", stacked * math.prod(shape)),
        ("the logits of a microbatch", stacked * positions * max(vocabs)),
        key=lambda item: item[1],
    )


def estimate(cfg: TrainConfig, longest: int | None = None, decided: Decided | None = None) -> Estimate:
    """The run's memory at its peak, from its validated config and what it decides (the preflight's
    `decided`; None: `decided.decide`'s, for a caller without a preflight); `longest`: the data's longest
    example in ids, once the data is built (None: the longest the config allows, `row_ids`)."""
    decided = decide(cfg) if decided is None else decided
    model = model_with_vocabs(cfg)
    by_role = params_by_role(model)
    workers, entry, replicas, streams = processes(cfg, decided)
    shards = decided.layout.ranks_per_replica if cfg.processes.shard and decided.layout else 1
    rank_by_role = params_by_role(model, shards)
    stacked = replicas_at_once(cfg.engine.name, cfg.engine.stack, replicas)
    share = -(-ids_per_update(cfg) // cfg.replicas)  # a replica's ids at an update: V_m = U[m::R]
    share = -(-share // streams)  # a rank's part of it under the benchmark layout
    row = row_ids(cfg, longest)
    rows, positions = microbatch(cfg, share, row, cfg.inner.micro_batch)
    heldout_positions = microbatch(cfg, cfg.data.heldout, row, HELDOUT_ROWS_PER_PASS)[1]
    train, heldout = activation_floats(model)
    activations = max(stacked * positions * train, heldout_positions * heldout) * FLOAT_BYTES
    channels = model_spec(model).id_channels(model)
    variable = data_source(cfg.data).variable_length(cfg.data)
    per_id = row * (channels * ID_BYTES + (1 if variable else 0))  # a padded row's ids and its mask
    round_updates = min(cfg.inner.H, cfg.phase.updates)  # assignments() builds a round's batches at once
    params = sum(by_role.values())
    state = model_state_bytes(cfg, rank_by_role, replicas, stacked)  # a sharded rank's: its shards'
    return Estimate(
        params=params,
        weights=params * FLOAT_BYTES,
        rank_weights=sum(rank_by_role.values()) * FLOAT_BYTES,
        state=state + (gathered_bytes(model) if shards > 1 else 0),
        activations=activations,
        codec=codec_bytes(cfg, model),
        batches=(round_updates * replicas * share + cfg.data.heldout) * per_id,
        checkpoint=checkpoint_bytes(cfg, decided, by_role, replicas, workers),
        workers=workers,
        entry=entry,
        replicas=replicas,
        stacked=stacked,
        rows=rows,
        positions=positions,
        largest=largest_tensor(model, stacked, positions),
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_room(limit_file: Path, usage_file: Path) -> int | None:
    """A cgroup's limit less its usage; None without a limit (or the files)."""
    limit, usage = _read(limit_file), _read(usage_file)
    if limit is None or usage is None or not limit.isdigit() or not usage.isdigit():
        return None  # "max" (v2): no limit
    return None if int(limit) >= NO_LIMIT else max(0, int(limit) - int(usage))


def host_available(
    meminfo: Path = MEMINFO, cgroup_v2: Path = CGROUP_V2, cgroup_v1: Path = CGROUP_V1
) -> tuple[int, str] | None:
    """(bytes, where the figure comes from): the least of /proc/meminfo's MemAvailable and the room
    left under this process's cgroup's limit (v2 memory.max, v1 memory.limit_in_bytes); None where
    none of them can be read (then nothing is refused)."""
    figures = []
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemAvailable:"):
            figures.append((int(line.split()[1]) * 1024, "MemAvailable"))
    v2 = _cgroup_room(cgroup_v2 / "memory.max", cgroup_v2 / "memory.current")
    if v2 is not None:
        figures.append((v2, "cgroup memory.max less its use"))
    v1 = _cgroup_room(cgroup_v1 / "memory.limit_in_bytes", cgroup_v1 / "memory.usage_in_bytes")
    if v1 is not None:
        figures.append((v1, "cgroup memory.limit_in_bytes less its use"))
    return min(figures) if figures else None


def gpu_available(decided: Decided, workers: int) -> tuple[int, str]:
    """(bytes, where): the least free memory (torch.cuda.mem_get_info) of the GPUs the run's workers
    use: the decided device, or under processes=dist cuda:0.. one per worker on this machine
    (`Decided.on_rank`). Only called for a CUDA run: it initialises CUDA in this process."""
    import torch

    if decided.layout is not None:
        devices = [decided.on_rank(i).device for i in range(min(workers, torch.cuda.device_count()))]
    else:
        devices = [decided.device]
    return min((torch.cuda.mem_get_info(torch.device(d))[0], f"free on {d}") for d in devices)


UNITS = ("B", "kB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")


def readable(n: int) -> str:
    """Bytes in decimal units, three figures: 10.7 TB; beyond yottabytes in powers of ten."""
    exponent = min(len(UNITS) - 1, (len(str(n)) - 1) // 3) if n > 0 else 0
    value = n / 10 ** (3 * exponent)
    return f"{value:.3g} {UNITS[exponent]}" if value < 1000 else f"{n:.3g} B"


def _count(n: int) -> str:
    """A count in words beyond a million, three figures: 6.71 billion."""
    for size, word in ((10**12, "trillion"), (10**9, "billion"), (10**6, "million")):
        if n >= size:
            return f"{n / size:.3g} {word}" if n < 1000 * size or size < 10**12 else f"{n:.3g}"
    return f"{n:,}"


def _value(cfg: TrainConfig, path: str):
    node = cfg
    for key in path.split("."):
        node = getattr(node, key)
    return node


def _fields(cfg: TrainConfig, paths: list[str]) -> str:
    return ", ".join(f"{p}={_value(cfg, p)}" for p in paths)


def size_fields(cfg: TrainConfig) -> tuple[list[str], list[str]]:
    """(the fields that size the model, those that size a microbatch), as the user sets them."""
    m, d = cfg.model, cfg.data
    model = ["model.d_model", "model.n_layers"] + (["model.d_ff"] if m.d_ff else [])
    source = data_source(d)
    if not model_spec(m).channels:
        model += ["model.vocab"]
    elif m.channel_vocabs or not source.multistream:
        model += ["model.channel_vocabs"]
    else:  # the data fills them in (speech: the text vocabulary, then the codebooks')
        model += list(source.channel_fields)
    strong = cfg.phase.kind == "strong"
    batch = ["phase.global_batch"] if strong else ["phase.base_world", "phase.per_rank_batch"]
    if not source.variable_length(d):
        batch += (["inner.micro_batch"] if cfg.inner.micro_batch else []) + source.length_fields(d)
    else:
        batch += ["data.max_padded_tokens"] + source.length_fields(d)
    return model, batch


def parts(cfg: TrainConfig, est: Estimate, scope: str) -> list[tuple[int, str, list[str]]]:
    """The estimate's parts in `scope`: (bytes, what they are, the fields that size them). Scopes:
    "cpu" (the machine, everything on its host), "host" (the host of a GPU run: batches, runtime and
    checkpoint copies), "gpu" (one worker's device: its weights and state, and activations)."""
    model, batch = size_fields(cfg)
    times = 1 if scope == "gpu" else est.workers
    per = f" in each of {est.workers} processes" if est.workers > 1 and scope != "gpu" else ""
    stacked = f", {est.stacked} computed at once" if est.stacked != est.replicas else ""
    shard = f", a rank's shards {readable(est.rank_weights)}" if est.rank_weights != est.weights else ""
    dist = (
        ["processes.nproc" if cfg.processes.nproc else "world.size"] if cfg.processes.name == "dist" else []
    )
    device = [
        (
            times * est.state,
            f"weights {readable(est.weights)} ({_count(est.params)} parameters){shard} x "
            f"{est.state / est.rank_weights:,.1f} copies for {est.replicas} replicas{stacked}{per}: weights, "
            "gradients, optimizer state, the global weights",
            [*model, "replicas"],
        ),
        (
            times * est.activations,
            f"activations {readable(times * est.activations)}: {est.stacked} x {est.rows:,} rows, "
            f"{est.positions:,} positions each, per microbatch{per}",
            [*batch, *model],
        ),
    ]
    if est.codec:
        shaping = (
            ("outer.codec.tile", cfg.outer.codec.tile),
            ("outer.codec.transform", cfg.outer.codec.transform == Transform.dct),
        )
        codec = ["outer.compress", "outer.codec.block"] + [field for field, used in shaping if used]
        device.append(
            (
                times * est.codec,
                f"the codec's blocks {readable(times * est.codec)}: every replica's pseudo-gradient padded "
                f"to its longest block{per}",
                [*codec, *model, "replicas"],
            )
        )
    host = [
        (
            times * est.batches,
            f"batches {readable(times * est.batches)}: a round's token ids",
            [*batch, "inner.H"],
        ),
        (
            (est.workers + est.entry) * RUNTIME_BYTES + est.checkpoint,
            f"runtime {readable(RUNTIME_BYTES)} x {est.workers + est.entry} process(es)"
            + (f", checkpoint copies {readable(est.checkpoint)}" if est.checkpoint else ""),
            dist or [*model, "replicas"],
        ),
    ]
    return {"cpu": device + host, "host": host, "gpu": device}[scope]


def refusal(cfg: TrainConfig, est: Estimate, scope: str, need: int, available: tuple[int, str]) -> str:
    """The one line: the fields that size the largest part, the estimate and its parts, the memory."""
    pieces = parts(cfg, est, scope)
    lead = max(pieces, key=lambda piece: piece[0])[2]
    have, where = available
    on = " on each GPU" if scope == "gpu" else " of host memory" if scope == "host" else ""
    return (
        f"{_fields(cfg, list(dict.fromkeys(lead)))} need about {readable(need)}{on} "
        f"({'; '.join(text for _, text, _ in pieces)}) but {readable(have)} is available ({where}); "
        "valid: smaller sizes, or guard.memory_check=false to skip this check"
    )


def check_indexable(cfg: TrainConfig, est: Estimate) -> None:
    """No tensor of the run has more elements than torch can index (2**63 - 1): UserError."""
    what, elements = est.largest
    if elements > INT64_MAX:
        model, batch = size_fields(cfg)
        raise UserError(
            f"{_fields(cfg, model + batch)} give {what} of {elements:.3g} elements, more than a tensor "
            f"can hold ({INT64_MAX}); valid: smaller sizes"
        )


def check(cfg: TrainConfig, longest: int | None = None, decided: Decided | None = None) -> Estimate:
    """Refuse (UserError, one line) a validated run whose estimate exceeds HEADROOM of the memory
    available: the host's, and on a GPU each worker's device's; a tensor beyond what torch can index
    is refused even with guard.memory_check=false. Returns the estimate. `decided`: as `estimate`'s."""
    decided = decide(cfg) if decided is None else decided
    if not model_spec(cfg.model).channels and cfg.model.vocab == 0:  # the data's: named as it will be
        cfg = replace(cfg, model=model_with_vocabs(cfg))
    est = estimate(cfg, longest, decided)
    check_indexable(cfg, est)
    if not cfg.guard.memory_check:
        return est
    checks = [("cpu", est.host(on_gpu=False), host_available)]
    if decided.device.startswith("cuda"):  # the host holds the batches, the GPUs the rest
        checks = [
            ("host", est.host(on_gpu=True), host_available),
            ("gpu", est.device, lambda: gpu_available(decided, est.workers)),
        ]
    for scope, need, available in checks:
        have = available()
        if have is not None and need > HEADROOM * have[0]:
            raise UserError(refusal(cfg, est, scope, need, have))
    return est
