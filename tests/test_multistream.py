"""The multistream model's loss: exact for any partition into ranks and microbatches.

docs/design.md ("Loss weights"): per replica and update, the token mean of each channel over the
replica batch, combined as `sum_c k_c * mean_c / sum_c k_c` over the channels that have targets.
The data here is a small synthetic multistream set made in the test (random tokens; holes where a
channel has no token, as a delayed codebook's first frame; a channel with no targets at all in some
examples; examples of 2 to 13 positions): the property is arithmetic, so any tokens exercise it.

- The reference objective is computed in the test from its definition: one padded batch of all
  the replica's examples, the model's per-channel cross-entropy sums (`model.channel_sums`) divided
  by the channel's target count, combined with the k's. Everything in float64.
- The partitioned loss is what training computes: `batches.replica_batch` microbatches (one-example
  ones included) weighted by the plan's per-token channel weights, summed over microbatches and
  averaged over L ranks that each hold part of the replica's ids (the benchmark layout).
- Bound: float64 throughout. Each gradient entry is a sum of at most M = (positions) x (d_model)
  products, each rounded with unit roundoff u = 2^-53; summed in another order it differs by at
  most 2 M u times the sum of the terms' magnitudes, which is at most a few times the gradient's
  largest entry here (cross-entropy gradients are bounded by 1 per logit). M < 2^11 here, so
  1e-11 x max |gradient| covers 2 M u = 2^-41 ~ 4.5e-13 with margin (factor ~20), and is still
  eight orders of magnitude below the negative control's difference.
- Negative control: the mean of microbatch means (each microbatch's own channel combination,
  microbatches weighted equally) is a different objective: its gradient must fail the check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from hypertrain.config import DataConfig, InnerConfig, ModelConfig
from hypertrain.data.batches import channel_targets, pad_channels, replica_batch
from hypertrain.engines.contract import microbatch_loss
from hypertrain.model.shapes import param_roles
from hypertrain.model.transformer import channel_sums, init_params
from hypertrain.optim.inner import init_state, uses_muon

VOCABS = [23, 9, 9, 9]  # text, then three codebooks
SCALES = [1.0] + [32.0 / 3] * 3  # the seed's k: text 1, each of K codebooks 32/K
REL = 1e-11  # see the module docstring


@dataclass
class SyntheticStreams:
    """Multistream examples [C, L]: the interface `batches.replica_batch` reads."""

    n_total: int = 40
    seed: int = 0
    empty_channel_below: int = 10  # examples with ids below this have no token in channel 3

    channel_vocabs = tuple(VOCABS)
    channel_scales = tuple(SCALES)
    fixed_length = False

    def __post_init__(self):
        gen = np.random.default_rng(self.seed)
        self.rows = []
        for i in range(self.n_total):
            length = int(gen.integers(2, 14))
            row = np.stack([gen.integers(0, v, length) for v in VOCABS]).astype(np.int64)
            row[1:, 0] = -1  # codebooks delayed by one position: none at the first
            row[0, gen.random(length) < 0.2] = -1  # text holes
            if i < self.empty_channel_below:
                row[3] = -1
            self.rows.append(row)

    def get(self, i: int) -> np.ndarray:
        return self.rows[i].copy()

    def lengths(self, ids) -> np.ndarray:
        return np.array([self.rows[int(i)].shape[1] for i in ids], dtype=np.int64)

    def channel_counts(self, ids) -> np.ndarray:
        return np.array([(self.rows[int(i)][:, 1:] >= 0).sum(1) for i in ids], dtype=np.int64)


def model_cfg() -> ModelConfig:
    return ModelConfig(
        arch="multistream", channel_vocabs=VOCABS, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2
    )


def float64_params(seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        n: t.double().unsqueeze(0).requires_grad_(True) for n, t in init_params(model_cfg(), seed).items()
    }


def gradient(loss: torch.Tensor, params: dict) -> torch.Tensor:
    grads = torch.autograd.grad(loss, list(params.values()))
    return torch.cat([g.reshape(-1) for g in grads])


def reference_objective(data: SyntheticStreams, ids: np.ndarray, params: dict) -> torch.Tensor:
    """sum_c k_c mean_c / sum_{c with targets} k_c over one padded batch of all `ids`."""
    tokens, _ = pad_channels([data.get(int(i)) for i in ids])
    sums = channel_sums(model_cfg(), params, tokens.unsqueeze(0))[0]
    counts = torch.from_numpy(channel_targets(tokens)).double()
    k = torch.tensor(SCALES, dtype=torch.float64)
    active = counts > 0
    means = torch.where(active, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return (k * means).sum() / k[active].sum()


def partitioned_loss(data, ids: np.ndarray, params: dict, ranks: int, max_examples: int) -> torch.Tensor:
    """Training's loss: each of `ranks` ranks holds a contiguous part of `ids`; its microbatches of at
    most `max_examples` examples are weighted with the replica's totals; the ranks' losses averaged."""
    cfg = _train_cfg()
    data_cfg = DataConfig(examples="documents", max_examples=max_examples, max_padded_tokens=10_000)
    total = torch.zeros((), dtype=torch.float64)
    for share in np.array_split(ids, ranks):
        batch = replica_batch(data, share, data_cfg, 0, replica_ids=ids, world=ranks)
        for mb in batch.microbatches:
            total = total + microbatch_loss(cfg, params, mb)
    return total / ranks


def _train_cfg():
    from hypertrain.config import TrainConfig

    return TrainConfig(model=model_cfg())


def assert_same_gradient(got: torch.Tensor, want: torch.Tensor) -> None:
    bound = REL * float(want.abs().max())
    assert float((got - want).abs().max()) <= bound


PARTITIONS = [(1, 16), (1, 1), (1, 3), (2, 2), (3, 1), (4, 5)]  # (ranks, examples per microbatch)


@pytest.mark.parametrize(("ranks", "max_examples"), PARTITIONS)
def test_any_partition_into_ranks_and_microbatches_gives_the_single_batch_gradient(ranks, max_examples):
    data = SyntheticStreams()
    ids = np.arange(4, 20)  # ids 4..9 lack channel 3, ids 10..19 have it
    params = float64_params()
    want = gradient(reference_objective(data, ids, params), params)
    got = gradient(partitioned_loss(data, ids, params, ranks, max_examples), params)
    assert_same_gradient(got, want)


def test_a_channel_without_targets_leaves_the_objective_and_its_k_the_normaliser():
    """Ids 0..9 hold no channel-3 token: the objective is the other channels' combination, exactly
    as if channel 3 did not exist, and nothing is NaN (one-example microbatches included)."""
    data = SyntheticStreams()
    ids = np.arange(0, 8)
    params = float64_params()
    loss = partitioned_loss(data, ids, params, ranks=2, max_examples=1)
    assert torch.isfinite(loss)
    tokens, _ = pad_channels([data.get(int(i)) for i in ids])
    sums = channel_sums(model_cfg(), params, tokens.unsqueeze(0))[0]
    counts = torch.from_numpy(channel_targets(tokens)).double()
    assert counts[3] == 0 and (counts[:3] > 0).all()
    k = torch.tensor(SCALES[:3], dtype=torch.float64)
    three_channels = (k * sums[:3] / counts[:3]).sum() / k.sum()
    assert_same_gradient(gradient(loss, params), gradient(three_channels, params))


def test_the_mean_of_microbatch_means_is_another_objective():
    """Negative control: the check above fails for the objective the exact weighting replaces."""
    data = SyntheticStreams()
    ids = np.arange(4, 20)
    params = float64_params()
    want = gradient(reference_objective(data, ids, params), params)
    data_cfg = DataConfig(examples="documents", max_examples=3, max_padded_tokens=10_000)
    batch = replica_batch(data, ids, data_cfg, 0)
    own = [
        reference_objective(data, ids[_rows_of(batch, j, ids, data)], params)
        for j in range(len(batch.microbatches))
    ]
    naive = torch.stack(own).mean()
    got = gradient(naive, params)
    with pytest.raises(AssertionError):
        assert_same_gradient(got, want)


def _rows_of(batch, j: int, ids: np.ndarray, data: SyntheticStreams) -> list[int]:
    """The positions in `ids` of microbatch j's examples (found by their tokens)."""
    tokens = batch.microbatches[j].tokens
    found = []
    for row in tokens:
        for pos, i in enumerate(ids):
            example = data.get(int(i))
            if (
                pos not in found
                and example.shape[1] <= row.shape[1]
                and torch.equal(torch.from_numpy(example), row[:, : example.shape[1]])
                and bool((row[:, example.shape[1] :] < 0).all())
            ):
                found.append(pos)
                break
    assert len(found) == tokens.shape[0]
    return found


def test_muon_takes_the_hidden_matrices_and_adamw_every_embedding_head_and_norm():
    """Roles, not names: every channel's embedding and head (however many channels) is AdamW's."""
    cfg = model_cfg()
    roles = param_roles(cfg)
    muon = InnerConfig(name="muon")
    taken = sorted(n for n, role in roles.items() if uses_muon(muon, role))
    assert taken == sorted(n for n in roles if n.startswith("layers.") and not n.endswith("norm"))
    params = {n: t.unsqueeze(0) for n, t in init_params(cfg, 0).items()}
    state = init_state(muon, params, roles)
    for c in range(len(VOCABS)):
        assert f"emb.{c:02d}" in state.v and f"head.{c:02d}" in state.v  # AdamW's second moment
    assert not any(n in state.v for n in taken)


# -- the engines ------------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.parametrize(("R", "H", "stack"), [(3, 2, 0), (3, 2, 2)])
def test_stacked_equals_loop_on_multistream_data(monkeypatch, optimizer, R, H, stack):
    """test_stacked's check (each fp32 engine against the float64 loop, within twice the loop's own
    error or its derived floor) on multistream examples of unequal lengths and channel holes, with
    microbatches cut by the padded-token bound."""
    from dataclasses import replace

    from helpers import assert_engines_agree, cfg_for

    from hypertrain.preflight import prepare

    data = SyntheticStreams(n_total=120, empty_channel_below=30)
    data.fingerprint, data.description = "synthetic-multistream", "synthetic multistream examples"
    monkeypatch.setattr(prepare, "build_dataset", lambda cfg: data)
    base = cfg_for(R, H, stack, name=optimizer)
    cfg = replace(
        base,
        model=model_cfg(),
        data=replace(base.data, examples="documents", heldout=8, max_examples=3, max_padded_tokens=40),
    )
    assert_engines_agree(cfg)


# -- on the synthesised speech (data=speech, a small build made here) -------------------------------

SPEECH = [
    "data=speech",
    "data.codebooks=4",
    "data.codebook_size=64",
    "data.quantizer_frames=4096",
    "data.text_vocab=400",
    "data.heldout=32",
]


@pytest.fixture(scope="module")
def speech(tmp_path_factory) -> list[str]:
    """The overrides of a small speech build (600 sentences, about 420 utterances, ~15 s), built once
    with `python -m hypertrain.data.speech build` into a directory of this module."""
    cache = tmp_path_factory.mktemp("speech")
    overrides = [*SPEECH, "data.speech_sentences=600", f"data.cache_dir={cache}"]
    build_speech(overrides)
    return overrides


def build_speech(overrides: list[str]) -> None:
    """`python -m hypertrain.data.speech build` with the data fields of `overrides` (espeak-ng is installed by
    `scripts/setup --dev`: its absence fails, naming the set-up)."""
    import subprocess
    import sys

    args = [a for a in overrides if a.startswith("data.") and not a.startswith("data.heldout")]
    command = [sys.executable, "-m", "hypertrain.data.speech", "build", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{done.stderr.strip()} (`scripts/setup --dev` installs espeak-ng)"


@pytest.mark.slow
def test_real_processes_equal_the_simulation_on_speech(tmp_path, speech):
    """processes=dist at world 2, R = 1: the benchmark layout, 2 ranks per replica, each weighing its
    share's channels with the replica's totals (world L = 2) before the gradients are averaged. The
    entry's losses, held-out losses and final weights against the one-process loop, each within twice
    the loop's own error against the float64 loop (test_dist's check)."""
    from helpers import DIST, compose_cfg, finish, rounding_floors, simulate, start_entry
    from references import assert_losses_within_rounding, assert_within_rounding

    from hypertrain.rundir.records import read_metrics

    overrides = [
        *[a for a in DIST if not a.startswith(("data.", "model."))],
        *speech,
        "model=multistream_tiny",
        "world=2",
        "replicas=1",
        "inner.H=2",
        "phase.global_batch=16",
        "phase.updates=6",
    ]
    proc = start_entry([*overrides, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    cfg = compose_cfg(overrides)
    batches: list = []
    ref_losses, ref_evals, ref_theta, _ = simulate(cfg, torch.float64, batches)
    sim_losses, sim_evals, sim_theta, _ = simulate(cfg)
    done = finish(proc)
    assert done.returncode == 0, done.stderr
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert {k: v for r in rows if r["kind"] == "summary" for k, v in r.items()}[
        "engine/layout"
    ] == "benchmark"
    losses = [r["loss"] for r in rows if r["kind"] == "update"]
    loss_floor, weight_floor = rounding_floors(cfg, batches, len(ref_losses))
    assert_losses_within_rounding(losses, sim_losses, ref_losses, loss_floor)
    evals = [r["eval_loss"] for r in rows if r["kind"] in ("eval", "sync")]
    assert_losses_within_rounding([evals], [sim_evals], [ref_evals], loss_floor)
    weights = torch.load(tmp_path / "run" / "weights.pt")
    for n, t in ref_theta.items():
        assert_within_rounding(weights[n], sim_theta[n], t, weight_floor * float(t.norm()), n)
    channels = [r for r in rows if r["kind"] == "sync"][-1]
    assert 0 < channels["eval_loss_text"] and 0 < channels["eval_loss_audio_mean"]
    # The per-channel training losses reach the records (their values: the test below).
    assert all(r["loss/text"] > 0 and r["loss/audio_mean"] > 0 for r in rows if r["kind"] == "update")


@pytest.mark.slow  # the speech fixture's build (~25 s)
def test_worlds_8_and_16_give_the_same_losses_in_simulation(speech):
    """In simulation W is a label: the replicas' batches, and so their losses, do not depend on it."""
    from helpers import compose_cfg, simulate

    base = [*speech, "model=multistream_tiny", "replicas=2", "inner.H=2", "phase.global_batch=16"]
    base += ["phase.timing_warmup=0"]
    eight = simulate(compose_cfg([*base, "world='8'", "phase.updates=4"]))[0]
    sixteen = simulate(compose_cfg([*base, "world='16'", "phase.updates=4"]))[0]
    assert eight == sixteen and len(eight) == 4


def unigram_entropies(dataset, ids) -> list[float]:
    """Per channel, the entropy (nats) of its target tokens' frequencies over `ids`: the loss of the
    best model that ignores context, the baseline a learning model must beat."""
    counts = [np.zeros(v) for v in dataset.channel_vocabs]
    for i in ids:
        targets = dataset.get(int(i))[:, 1:]
        for c, row in enumerate(targets):
            np.add.at(counts[c], row[row >= 0], 1)
    entropies = []
    for count in counts:
        p = count[count > 0] / count.sum()
        entropies.append(float(-(p * np.log(p)).sum()))
    return entropies


@pytest.mark.slow
def test_the_multistream_model_learns_text_and_audio(tmp_path):
    """multistream_tiny, one replica, every training utterance of a 4000-sentence build once (182
    updates of 16; the build takes ~35 s and the run ~30 s on 2 cores): the held-out text loss
    and the held-out mean audio loss each end below 0.9 x their unigram baselines (the audio one
    against the mean of the codebooks' entropies)."""
    from helpers import compose_cfg, finish, start_entry

    from hypertrain.data import build_dataset
    from hypertrain.rundir.records import read_metrics

    overrides = [
        *[a for a in SPEECH if not a.startswith("data.heldout")],
        "data.heldout=64",
        "data.speech_sentences=4000",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model=multistream_tiny",
        "logger=none",
        "world='1'",
        "replicas=1",
        "inner.H=10",
        "phase.global_batch=16",
        "phase.updates=400",  # more than the stream holds: the run ends at its end (a warning says so)
        "phase.timing_warmup=2",
    ]
    build_speech(overrides)
    done = finish(start_entry([*overrides, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path), timeout=900)
    assert done.returncode == 0, done.stderr
    final = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "sync"][-1]
    cfg = compose_cfg(overrides)
    dataset = build_dataset(cfg.data)
    entropy = unigram_entropies(dataset, range(dataset.n_total - cfg.data.heldout))
    text, audio = entropy[0], float(np.mean(entropy[1:]))
    print(
        f"held-out text {final['eval_loss_text']:.3f} vs unigram {text:.3f}; "
        f"audio mean {final['eval_loss_audio_mean']:.3f} vs {audio:.3f} after {final['update']} updates"
    )
    assert final["eval_loss_text"] < 0.9 * text
    assert final["eval_loss_audio_mean"] < 0.9 * audio


def test_the_per_channel_training_losses_are_each_channels_token_mean():
    """One update of two replicas: the loop engine, in float64, reports for each replica each channel's
    token mean over its batch, as computed here from the definition (within float64 summation
    rounding, the gradient test's 1e-11); the stacked engine in fp32 agrees with the fp32 loop within
    twice the loop's own error against that float64 value (references.py's rule; floor: 64 U32, the
    roundings of a mean over fewer than 2^10 targets accumulated over a few microbatches)."""
    from references import U32, assert_within_rounding, float64_arithmetic

    from hypertrain.config import TrainConfig
    from hypertrain.engines import loop, stacked
    from hypertrain.engines.contract import Assignment

    data = SyntheticStreams(n_total=60, empty_channel_below=4)
    data_cfg = DataConfig(examples="documents", max_examples=3, max_padded_tokens=40)
    cfg = TrainConfig(model=model_cfg(), data=data_cfg)
    shares = [np.arange(0, 4), np.arange(4, 20)]  # replica 0's examples have no channel-3 token
    theta = init_params(cfg.model, 0)
    roles = param_roles(cfg.model)

    def one_update(engine, dtype):
        start = {n: t.to(dtype) for n, t in theta.items()}
        assigns = [Assignment(m, 0, [replica_batch(data, ids, data_cfg, 0)]) for m, ids in enumerate(shares)]
        states = [init_state(cfg.inner, {n: t.unsqueeze(0) for n, t in start.items()}, roles) for _ in shares]
        return [r.channel_losses[0] for r in engine(cfg, start, assigns, states)]

    with float64_arithmetic():
        exact = one_update(loop.train_replicas, torch.float64)
        params = {n: t.double().unsqueeze(0) for n, t in theta.items()}
        for got, ids in zip(exact, shares, strict=True):
            tokens, _ = pad_channels([data.get(int(i)) for i in ids])
            sums = channel_sums(cfg.model, params, tokens.unsqueeze(0))[0]
            counts = torch.from_numpy(channel_targets(tokens)).double()
            want = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
            assert (counts[3] == 0) == (ids[0] == 0)
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=REL, atol=REL)
    ref = torch.tensor(exact)
    fp32_loop = torch.tensor(one_update(loop.train_replicas, torch.float32))
    fp32_stacked = torch.tensor(one_update(stacked.train_replicas, torch.float32))
    assert_within_rounding(fp32_stacked, fp32_loop, ref, 64 * U32 * float(ref.norm()), "channel losses")


@pytest.mark.slow  # the speech fixture's build, then two 4-process runs side by side (measured below)
def test_a_sharded_multistream_run_equals_the_unsharded_one_bitwise(speech, tmp_path):
    """processes.shard=true (docs/distributed.md, "Sharded replicas") on the multistream model: each
    channel's embedding and head at the root, the layers as blocks; the channel sums and target counts
    averaged over the replica's ranks with the loss (layout (a)'s), a rank with fewer microbatches
    running ones of no tokens (every id -1: no input, no target, exact zeros). At L = 2 every sum of two
    terms is exact in either order, so per-replica losses, held-out losses, weights.pt and the update
    rows' text and audio losses are the unsharded benchmark run's, bitwise."""
    from helpers import DIST
    from test_sharded import assert_update_figures_equal, equal_side_by_side

    overrides = [
        *[a for a in DIST if not a.startswith(("data.", "model."))],
        *speech,
        "model=multistream_tiny",
        "world=4",
        "replicas=2",
        "inner.H=2",
        "phase.global_batch=16",
        "phase.updates=2",
        "checkpoint.every=0",
    ]
    equal_side_by_side(tmp_path, overrides)
    assert_update_figures_equal(tmp_path, ("loss/text", "loss/audio_mean"), 2)
