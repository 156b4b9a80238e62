"""Asynchronous replicas with codecs (outer.schedule=async with outer.compress, docs/async.md "Codecs"):
every arriving job's pseudo-gradient is the decoded payload its replica sent, checked against
references of the codecs' documented equations written here (int8, fp4_e2m1, e3m0: each block's nearest
grid value; uint8, fp8_*: their scale and cast; top-k: each block's largest magnitudes) applied to the
run's own pseudo-gradients, and a wrong scale or a missing buffer falls outside them; top-k's error
feedback follows e <- e + delta - C(e + delta) at every arrival of a replica; with the DCT transform
the applied values are the codec's on cosine coefficients computed here by an explicit cosine matrix;
with tiles top-k keeps each tile's largest values; the payload bits are recorded and the tensor handed to
the arrival's broadcast is exactly their bytes; loop = stacked bitwise; a SIGKILL resumes bitwise.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ReferenceRuns, assert_same_weights, killed_beside_uninterrupted, resumed
from references import templar_topk
from test_async import arrivals, async_cfg, four_one_slow

import hypertrain.diloco.asynchrony.asynchronous as asynchronous
from hypertrain.choices import Compressor
from hypertrain.codec_table import codec_entry
from hypertrain.config import LowRankConfig, TopKConfig
from hypertrain.diloco.asynchrony.arrivals import Job
from hypertrain.diloco.asynchrony.asynchronous import server_updates
from hypertrain.diloco.exchange.wire import Wire
from hypertrain.diloco.state import RunState
from hypertrain.distributed.groups import ReplicaGroups
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.records.files import read_records
from hypertrain.report.runs import load_run

BLOCK = 32
GRIDS = {  # the magnitudes over the block's scale, and the scale's divisor M (docs/compression.md)
    "int8": (None, 127.0),
    "fp4_e2m1": ((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0), 6.0),
    "e3m0": ((0.0,) + tuple(2.0 ** (e - 7) for e in range(1, 8)), 1.0),
}


def codec_cfg(compress, engine="stacked", **outer):
    return async_cfg(engine=engine, compress=Compressor[compress], **blocks_for(compress), **outer)


def blocks_for(compress: str) -> dict:
    """outer.codec.block=BLOCK where the codec reads it (`Codec.takes`: a block codec's)."""
    return {"block": BLOCK} if "block" in codec_entry(compress).takes else {}


def observed(cfg, also=None):
    """Run `cfg`; returns the sizes of its tensors, every arrival's (delta, buffer before, decoded, buffer
    after) in order (the buffers [1, n], None without error feedback), recorded around
    `asynchronous.arrived` (the owner's encode, the broadcast, every process's decode), every server
    update's applied deltas [k, n] and the final state. `also(state)`: more to record before and after
    each arrival, appended to its tuple (before, after)."""
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    calls, applied = [], []
    arrive, apply = asynchronous.arrived, state.asynchronous.server.apply

    def buffer(m):
        if state.errors is None:
            return None
        return torch.cat([t.reshape(-1) for t in state.errors[m].values()])[None].clone()

    def recording_arrived(job, flying, groups, theta, wire=None):
        delta, before = flying[job.replica]["delta"].clone(), buffer(job.replica)
        extra = () if also is None else (also(state),)
        out = arrive(job, flying, groups, theta, wire)
        extra += () if also is None else (also(state),)
        calls.append((delta, before, out["delta"].clone(), buffer(job.replica), *extra))
        return out

    def recording_apply(theta, deltas, tokens):
        applied.append(deltas.clone())
        return apply(theta, deltas, tokens)

    asynchronous.arrived = recording_arrived
    state.asynchronous.server.apply = recording_apply
    try:
        for _ in server_updates(run, state):
            pass
    finally:
        asynchronous.arrived = arrive
    sizes = tuple(t.numel() for t in state.theta.values())
    return sizes, calls, applied, state


def blocks_of(x, sizes):
    """The blocks of the flat vector `x` (outer.codec.block values, never across a tensor): slices."""
    out, start = [], 0
    for size in sizes:
        for a in range(0, size, BLOCK):
            out.append(slice(start + a, start + min(a + BLOCK, size)))
        start += size
    return out


def grid_reference(codec, x, sizes, divisor_scale=1.0):
    """Each block's values as the nearest of the codec's grid (chosen in float64, an exact tie to the
    even index; int8: round half even, clamped) times its scale amax / M, the scale and x / scale in fp32 as
    the codec documents them (`divisor_scale` scales M: a wrong scale for the negative control). Every
    block at once: the scale is each element's block's, and the rest is elementwise."""
    grid, M = GRIDS[codec]
    blocks = blocks_of(x, sizes)
    ids = torch.cat([torch.full((b.stop - b.start,), i) for i, b in enumerate(blocks)])
    v = x.float()
    amax = torch.zeros(len(blocks)).scatter_reduce(0, ids, v.abs(), "amax")
    scale = (amax / torch.tensor(M * divisor_scale, dtype=torch.float32))[ids]
    live = scale != 0  # an all-zero block decodes to zeros
    r = (v[live] / scale[live]).double()
    if grid is None:
        q = torch.round(r).clamp(-127, 127)
    else:
        g = torch.tensor(grid, dtype=torch.float64)
        d = (r.abs()[:, None] - g[None]).abs()
        nearest = d == d.min(1, keepdim=True).values
        even = nearest & (torch.arange(len(grid)) % 2 == 0)[None]
        index = torch.where(nearest.sum(1) > 1, even.float().argmax(1), d.argmin(1))
        q = torch.sign(r) * g[index]
    out = torch.zeros_like(x, dtype=torch.float64)
    out[live] = (q.float() * scale[live]).double()
    return out


def topk_reference(x, sizes, fraction):
    """float64: each block's ceil(fraction * L) largest magnitudes kept, the rest zero."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for b in blocks_of(x, sizes):
        v = x[b].double()
        k = max(1, math.ceil(fraction * len(v)))
        keep = v.abs().topk(k).indices
        out[b.start + keep] = v[keep]
    return out


@pytest.mark.parametrize("codec", ["int8", "fp4_e2m1", "e3m0"])
def test_each_arrival_applies_its_replicas_payload_the_codecs_grid_and_a_wrong_scale_is_not(codec):
    sizes, calls, applied, _ = observed(codec_cfg(codec))
    assert len(calls) == 8 and len(applied) == 8
    flat_applied = [d for deltas in applied for d in deltas]
    for (delta, before, decoded, after), got in zip(calls, flat_applied, strict=True):
        assert before is None and after is None
        assert torch.equal(got, decoded)  # the server applies what was decoded
        want = grid_reference(codec, delta, sizes)
        bound = 4 * 2.0**-24 * delta.abs().max().double()
        assert (got.double() - want).abs().max() <= bound
        assert not torch.equal(got, delta)
        wrong = grid_reference(codec, delta, sizes, divisor_scale=1.25)
        assert (got.double() - wrong).abs().max() > 100 * bound


FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def other_reference(codec, x, sizes):
    """uint8: each block's minimum + round-half-even((x - min) / scale) * scale, scale = (max - min) / 255;
    fp8_*: (x / scale) cast to the format times scale, scale = amax / M (448, 57344); fp32 scales."""
    out = torch.zeros_like(x, dtype=torch.float64)
    for b in blocks_of(x, sizes):
        v = x[b].float()
        if codec == "uint8":
            low = v.min()
            scale = (v.max() - low) / 255
            step = scale if scale != 0 else torch.ones_like(scale)
            out[b] = (low + torch.round((v - low) / step).clamp(0, 255) * scale).double()
        else:
            dtype, M = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}[
                codec
            ]
            scale = v.abs().max() / M
            step = scale if scale != 0 else torch.ones_like(scale)
            out[b] = ((v / step).clamp(-M, M).to(dtype).float() * scale).double()
    return out


@pytest.mark.parametrize("codec", ["uint8", "fp8_e4m3", "fp8_e5m2"])
def test_the_other_elementwise_codecs_apply_their_documented_values(codec):
    sizes, calls, applied, _ = observed(codec_cfg(codec))
    flat_applied = [d for deltas in applied for d in deltas]
    assert len(calls) == len(flat_applied) == 8
    for (delta, _, decoded, _), got in zip(calls, flat_applied, strict=True):
        assert torch.equal(got, decoded) and not torch.equal(got, delta)
        bound = 4 * 2.0**-24 * delta.abs().max().double()
        assert (got.double() - other_reference(codec, delta, sizes)).abs().max() <= bound


def test_topk_with_error_feedback_follows_the_buffer_recursion_at_every_arrival_of_a_replica():
    fraction = 0.125
    cfg = codec_cfg("topk", topk=TopKConfig(fraction=fraction), error_feedback=True)
    sizes, calls, applied, state = observed(cfg)
    flat_applied = [d for deltas in applied for d in deltas]
    e = torch.zeros(sum(sizes), dtype=torch.float64)
    # replica 0 is the fast one: the calls alternate by arrival order; follow each replica's own buffer
    buffers = {}
    order = [m for update in _replica_order(cfg) for m in update]
    assert len(order) == len(calls)
    for m, (delta, before, decoded, after), got in zip(order, calls, flat_applied, strict=True):
        e = buffers.get(m, torch.zeros(sum(sizes), dtype=torch.float64))
        assert torch.equal(before[0].double(), e)  # the buffer carried from this replica's last arrival
        x = (before[0] + delta).double()  # fp32's sum, as a round forms it (communication.fed_back)
        c = topk_reference(x, sizes, fraction)
        assert torch.equal(decoded.double(), c) and torch.equal(got, decoded)
        buffers[m] = x - c  # exact: the kept entries leave 0, the rest leave x
        assert torch.equal(after[0].double(), buffers[m])
    # the buffers the run state holds (what a checkpoint saves) are the last ones
    for m, own in enumerate(state.errors):
        assert torch.equal(torch.cat([t.reshape(-1) for t in own.values()]).double(), buffers[m])
    # negative control: without its buffer, a later arrival's payload differs
    late = len(calls) - 1
    assert not torch.equal(topk_reference(calls[late][0], sizes, fraction), calls[late][2].double())


def _replica_order(cfg):
    run = prepare(cfg)
    return [[job.replica for job in u.jobs] for u in asynchronous.arrival_schedule(run)]


@pytest.mark.parametrize(
    "extra",
    [{"block": BLOCK}, {"block": BLOCK, "transform": "dct"}, {"block": 16, "tile": 4}],
    ids=["plain", "dct", "tile"],
)
def test_the_loop_and_stacked_engines_agree_bitwise_with_topk_and_error_feedback(extra):
    """Four replicas, one half as fast, with DyLU (the three fast ones' jobs stacked in one call): the
    weights and every error buffer equal the loop engine's; with the DCT transform and with tiles too."""
    got = []
    for engine in ("stacked", "loop"):
        outer = dict(
            compress=Compressor.topk, topk=TopKConfig(fraction=0.125), error_feedback=True, dylu=True, **extra
        )
        base = async_cfg(engine=engine, **outer)
        cfg = four_one_slow(base, engine)
        got.append(observed(cfg)[3])
    for name, t in got[1].theta.items():
        assert torch.equal(got[0].theta[name], t), name
    assert len(got[0].errors) == 4
    for a, b in zip(got[0].errors, got[1].errors, strict=True):
        assert any(t.any() for t in a.values())
        for name, t in a.items():
            assert torch.equal(b[name], t), name


CODEC = ["outer.compress=int8", f"outer.codec.block={BLOCK}"]
TOPK_EF = [
    "outer.compress=topk",
    "outer.topk.fraction=0.125",
    "outer.error_feedback=true",
    f"outer.codec.block={BLOCK}",
]


def test_an_async_run_records_each_arrivals_payload_bits_and_their_total(tmp_path):
    from test_async import ASYNC

    run_dir = ReferenceRuns.beside(tmp_path)([*ASYNC, *CODEC])
    rows = arrivals(run_dir)
    sizes = [t.numel() for t in torch.load(run_dir / "weights.pt").values()]
    n, C = sum(sizes), sum(-(-s // BLOCK) for s in sizes)  # int8: n + 4C bytes (docs/compression.md)
    assert all(r["payload_bits"] == [8 * (n + 4 * C)] * len(r["replicas"]) for r in rows)
    summary = {}
    for r in read_records(run_dir / "metrics.jsonl"):
        if r.kind == "summary":
            summary |= r.values
    assert summary["async/payload_bits"] == sum(sum(r["payload_bits"]) for r in rows) == 12 * 8 * (n + 4 * C)
    fp32 = arrivals(ReferenceRuns.beside(tmp_path)(ASYNC))
    assert all(r["payload_bits"] == [32 * n] * len(r["replicas"]) for r in fp32)
    # the report's outer bytes: per job the int8 payload's upload (n + 4C bytes) and an fp32 download (4n);
    # each of the 2 replicas applied 6 jobs (12 arrivals), so the most one moved is 6 jobs' worth
    run = load_run(run_dir)
    per_replica = [sum(1 for r in rows if m in r["replicas"]) for m in (0, 1)]
    assert per_replica == [6, 6]
    assert run.outer_total_bytes() == 6 * ((n + 4 * C) + 4 * n)
    assert run.outer_peak_bytes() == (n + 4 * C) + 4 * n < 8 * n  # below the fp32 job's 8n


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [[], ["outer.codec.transform=dct"], ["outer.codec.tile=4", "outer.codec.block=16"]],
    ids=["plain", "dct", "tile"],
)
def test_a_run_with_topk_and_error_feedback_killed_between_server_updates_resumes_bitwise(tmp_path, extra):
    """SIGKILL before server update 6: the error buffers are in the checkpoint; every arrival row and
    the weights equal the uninterrupted run's (top-k with error feedback; with the DCT; with tiles)."""
    from test_async import ASYNC

    args = [*ASYNC, *TOPK_EF, *extra]
    run_dir, reference = killed_beside_uninterrupted(args, tmp_path, "0:6:kill")
    resumed(args, run_dir, tmp_path)
    want = arrivals(reference)
    assert len(want) == 12 and arrivals(run_dir) == want
    assert_same_weights(torch.load(run_dir / "weights.pt"), torch.load(reference / "weights.pt"))


def test_a_non_finite_pseudo_gradient_reaches_the_server_as_nan_and_leaves_the_buffer():
    """A codec's bytes would hide a NaN from the held-out guard: the arrival's flag says x is not finite
    and every process applies NaN, the buffer unchanged; a finite x is encoded and moves the buffer."""
    outer = codec_cfg("int8", error_feedback=True).outer
    theta = {"w": torch.zeros(64)}
    errors = [{"w": torch.full((64,), 0.25)}]
    wire = Wire(outer, theta, errors, [0])
    job = Job(0, 1, 0, 1, 4, 0, 0.0, 1.0)
    delta = torch.arange(64, dtype=torch.float32)
    delta[5] = float("nan")
    got = asynchronous.arrived(job, {0: {"delta": delta, "losses": [1.0]}}, ReplicaGroups(1), theta, wire)
    assert got["delta"].isnan().all() and got["losses"] == [1.0]
    assert torch.equal(errors[0]["w"], torch.full((64,), 0.25))
    delta[5] = 1.0
    got = asynchronous.arrived(job, {0: {"delta": delta, "losses": [1.0]}}, ReplicaGroups(1), theta, wire)
    assert torch.isfinite(got["delta"]).all()
    assert not torch.equal(errors[0]["w"], torch.full((64,), 0.25))


# -- the DCT transform and tiles (outer.codec.transform=dct, outer.codec.tile) --------------------------

U = 2.0**-24  # fp32's unit roundoff


def dct_matrix(L):
    """float64 [L, L], written from the DCT-II's definition: row k is sqrt(2 / L) cos(pi (2i + 1) k / 2L)
    over i, row 0 scaled to sqrt(1 / L) (orthonormal: its inverse is its transpose)."""
    i = torch.arange(L, dtype=torch.float64)
    c = torch.cos(math.pi * (2 * i[None] + 1) * i[:, None] / (2 * L)) * math.sqrt(2 / L)
    c[0] /= math.sqrt(2)
    return c


def dct_tolerance(x_block):
    """What fp32 may move a coefficient by, against float64: the codec's forward DCT (a dot product of
    L terms with an orthonormal row: at most L u ||x||_2), the scale's own rounding (|k| <= 127 steps of
    an amax known to L u ||x||_2 over M) and the inverse DCT of the decoded block (again L u ||d||_2,
    ||d|| <= ||x|| + the quantization); 4 L u ||x||_2 covers their sum with room for the fp32 casts."""
    L = x_block.shape[-1]  # one block, or a row per block: a bound per row
    return 4 * L * U * x_block.double().norm(dim=-1, keepdim=x_block.dim() > 1) * (1 + math.sqrt(L))


def test_int8_with_the_dct_quantizes_each_blocks_cosine_coefficients_on_its_grid():
    """Each arrival's applied pseudo-gradient, taken back to coefficients by the cosine matrix written
    here, lies on int8's grid of its block's coefficients (k amax / 127, k = round-half-even(c / scale)
    of the float64 coefficients c) within `dct_tolerance`; the int8 of the parameters themselves (no
    transform) does not (negative control)."""
    sizes, calls, applied, _ = observed(codec_cfg("int8", transform="dct"))
    C = dct_matrix(BLOCK)
    flat_applied = [d for deltas in applied for d in deltas]
    assert len(calls) == len(flat_applied) == 8
    checked = 0
    assert all(size % BLOCK == 0 for size in sizes)  # every tensor here is whole blocks: rows of BLOCK
    for (delta, _, decoded, _), got in zip(calls, flat_applied, strict=True):
        assert torch.equal(got, decoded)
        plain = grid_reference("int8", delta, sizes).view(-1, BLOCK)
        x = delta.double().view(-1, BLOCK)
        c = x @ C.T  # every block's coefficients, a row each
        scale = c.abs().amax(1, keepdim=True) / 127
        tol = dct_tolerance(x)  # [blocks, 1]
        k = torch.round(c / scale)
        # away from a rounding tie, the applied coefficient is k scale (within what fp32 moves)
        clear = ((c / scale - torch.floor(c / scale) - 0.5).abs() * scale) > 2 * tol
        applied_c = got.double().view(-1, BLOCK) @ C.T
        assert ((applied_c - k * scale).abs() <= 2 * tol)[clear].all()
        checked += int(clear.sum())
        plain_fails = (((plain @ C.T - k * scale).abs() > 2 * tol) & clear).any(1)
        assert int(plain_fails.sum()) > 0.9 * len(x)  # the parameters' own grid is not the DCT's
    assert checked > 0.9 * 8 * sum(sizes)  # the few near a tie (within 2 tol of one) are not judged


def test_topk_with_the_dct_and_error_feedback_keeps_each_blocks_largest_coefficients_at_every_arrival():
    """x = e + delta at every arrival of a replica (its buffer the one its last arrival left); the applied
    block is C^T of x's cosine coefficients C x with all but the ceil(f L) largest magnitudes zeroed, within
    `dct_tolerance`; the buffer left is x - C(x), in the parameter domain (DeMo's residual). A replica
    without its buffer would send another payload (negative control)."""
    fraction = 0.125
    cfg = codec_cfg("topk", topk=TopKConfig(fraction=fraction), error_feedback=True, transform="dct")
    sizes, calls, applied, state = observed(cfg)
    C, keep = dct_matrix(BLOCK), math.ceil(fraction * BLOCK)
    flat_applied = [d for deltas in applied for d in deltas]
    order = [m for update in _replica_order(cfg) for m in update]
    buffers, judged = {}, 0
    for m, (delta, before, decoded, after), got in zip(order, calls, flat_applied, strict=True):
        assert torch.equal(got, decoded)
        assert torch.equal(before[0], buffers.get(m, torch.zeros(sum(sizes))))
        x = before[0] + delta  # fp32's sum, as a round forms it (communication.fed_back)
        for b in blocks_of(x, sizes):
            c = C @ x[b].double()
            top = c.abs().sort(descending=True).values
            if top[keep - 1] - top[keep] <= 2 * dct_tolerance(x[b]):
                continue  # the k-th and next magnitudes too close for fp32 to order as float64 does
            judged += 1
            kept = torch.where(c.abs() >= top[keep - 1], c, 0.0)
            assert (got[b].double() - C.t() @ kept).abs().max() <= dct_tolerance(x[b])
        assert torch.equal(after[0], x - decoded)  # e' = x - C(x), the fp32 difference
        buffers[m] = after[0]
    assert judged > 0.9 * len(calls) * len(blocks_of(x, sizes))
    for m, own in enumerate(state.errors):
        assert torch.equal(torch.cat([t.reshape(-1) for t in own.values()]), buffers[m])
    late = calls[-1]
    alone = late[0]  # the last arrival's delta without its buffer
    b = blocks_of(alone, sizes)[0]
    c = C @ alone[b].double()
    top = c.abs().sort(descending=True).values
    without = C.t() @ torch.where(c.abs() >= top[keep - 1], c, 0.0)
    assert (late[2][b].double() - without).abs().max() > 100 * dct_tolerance(alone[b])


TILE = 4


def tile_topk_reference(x, shapes, fraction, tile=TILE):
    """float64 top-k over SparseLoCo's chunks (templar's rule, tests/references.py): each chunk of each
    tensor keeps `templar_k` of k = ceil(f T^2) (a whole T x T tile's count) of its largest magnitudes.
    The negative control passes every tensor flat with `tile` T^2: runs of T^2 in the parameters' order."""
    out, start, k = torch.zeros_like(x, dtype=torch.float64), 0, math.ceil(fraction * TILE * TILE)
    v = x.double().numpy()
    for shape in shapes:
        n = math.prod(shape)
        for keep in templar_topk(v[start : start + n], shape, tile, k):
            out[start + keep] = x[start + keep].double()
        start += n
    return out


def test_topk_with_tiles_and_error_feedback_keeps_each_tiles_largest_values_at_every_arrival():
    """outer.codec.tile=4 (blocks of 16 = 4 x 4 tiles; templar's chunks of the others): every arrival's
    payload is each chunk's largest magnitudes of x = e + delta, exactly (top-k moves values, no
    arithmetic), and the buffer left is x - C(x); the same top-k over blocks of 16 in the parameters' own
    order is not (negative control)."""
    fraction = 0.125
    cfg = async_cfg(
        compress=Compressor.topk, topk=TopKConfig(fraction=fraction), error_feedback=True, tile=TILE, block=16
    )
    run = prepare(cfg)
    shapes = [tuple(t.shape) for t in initial_weights(run).values()]
    _, calls, applied, _ = observed(cfg)
    order = [m for update in _replica_order(cfg) for m in update]
    flat_applied = [d for deltas in applied for d in deltas]
    buffers, differs = {}, 0
    for m, (delta, before, decoded, after), got in zip(order, calls, flat_applied, strict=True):
        assert torch.equal(got, decoded)
        assert torch.equal(before[0], buffers.get(m, torch.zeros_like(delta)))
        x = before[0] + delta
        assert torch.equal(got.double(), tile_topk_reference(x, shapes, fraction))
        assert torch.equal(after[0], x - decoded)
        buffers[m] = after[0]
        untiled = tile_topk_reference(x, [(math.prod(s),) for s in shapes], fraction, tile=TILE * TILE)
        differs += not torch.equal(got.double(), untiled)
    assert differs == len(calls)


class CountingGroups(ReplicaGroups):
    """One process whose arrival broadcast records each tensor handed to it: (dtype, bytes)."""

    def __init__(self, replicas):
        super().__init__(replicas)
        self.sent = []

    def share_arrival(self, replica, delta, losses):
        self.sent.append((delta.dtype, delta.numel() * delta.element_size()))
        return super().share_arrival(replica, delta, losses)


def expected_bytes(compress, shapes):
    """An arrival's payload bytes from docs/compression.md, written here: fp32 4 n; int8 n + 4 C (a byte
    a value, an fp32 scale a block of 32); lowrank 4 (sum over matrices of (rows + cols) r + the 1-D
    tensors' elements), r = min(2, rows, cols); None where the test takes the row's own count."""
    n = sum(math.prod(s) for s in shapes)
    if compress == "none":
        return 4 * n
    if compress == "int8":
        return n + 4 * sum(-(-math.prod(s) // BLOCK) for s in shapes)
    if compress == "lowrank":
        total = 0
        for s in shapes:
            rows, cols = s[0], math.prod(s) // s[0]
            total += (rows + cols) * min(2, rows, cols) if len(s) >= 2 else math.prod(s)
        return 4 * total
    return None


@pytest.mark.parametrize(
    ("compress", "outer"),
    [
        ("none", {}),
        ("int8", {}),
        ("int8", {"transform": "dct"}),
        ("topk", {"topk": TopKConfig(fraction=0.125), "error_feedback": True}),
        ("lowrank", {"lowrank": LowRankConfig(rank=2), "error_feedback": True}),
    ],
    ids=["fp32", "int8", "int8-dct", "topk-ef", "lowrank-ef"],
)
def test_an_arrivals_broadcast_carries_exactly_its_payload_bits(compress, outer):
    """The tensor handed to `share_arrival` (under processes=dist, the broadcast) is the payload's bytes,
    uint8, exactly payload_bits / 8 of the arrival's row (and the count written above where it has one);
    fp32 without a codec."""
    cfg = async_cfg(compress=Compressor[compress], **blocks_for(compress), **outer)
    run = prepare(cfg)
    state = RunState.start(run.cfg, initial_weights(run))
    shapes = [tuple(t.shape) for t in state.theta.values()]
    groups = CountingGroups(cfg.replicas)
    bits = [b for update in server_updates(run, state, groups=groups) for b in update.bits]
    assert len(groups.sent) == len(bits) == 8 and all(b % 8 == 0 for b in bits)
    assert [nbytes for _, nbytes in groups.sent] == [b // 8 for b in bits]
    want = expected_bytes(compress, shapes)
    assert want is None or all(nbytes == want for _, nbytes in groups.sent)
    dtype = torch.float32 if compress == "none" else torch.uint8
    assert all(d == dtype for d, _ in groups.sent)
