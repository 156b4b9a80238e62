"""data=prepared: examples from a prepared corpus's documents, whole held-out documents of every source,
and replica_split=by_source giving each replica its own source's ids (docs/data.md)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    KILLED,
    RUN,
    assert_identical,
    compose_cfg,
    data_command,
    entry,
    error_lines,
    killed_beside_uninterrupted,
    resumed,
    stderr_lines,
    tree,
)
from omegaconf import OmegaConf

from hypertrain import plan
from hypertrain.config import DataConfig, UserError
from hypertrain.data import build_dataset, corpus, data_source
from hypertrain.data.prepared import heldout_per_source
from hypertrain.preflight.prepare import initial_weights, prepare
from hypertrain.records.files import merged_summary, read_metrics
from hypertrain.records.rows import EvalRow
from hypertrain.report.runs import load_run
from hypertrain.report.sources import data_section
from hypertrain.run.evaluation import heldout_eval


def write_corpus(directory: Path, documents: list[list[int]], seed: int = 0) -> corpus.Meta:
    """A `bytes` corpus whose source s holds documents[s] documents of random lengths (a byte's value
    names its source: s * 50 + something, so a window's source can be read off its tokens)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    per_source, sources = [], []
    for s, (count, low, high) in enumerate(documents):
        lengths = rng.integers(low, high, count)
        per_source.append([(s * 50 + rng.integers(1, 50, n)).astype(np.int64) for n in lengths])
        sources.append(corpus.SourceMeta(f"source{s}", 1, 0, 0, f"{s:064x}"))
    return corpus.write(
        directory,
        per_source,
        sources,
        vocab=corpus.BYTES_VOCAB,
        eod=corpus.BYTES_EOD,
        tokenizer="bytes",
        tokenizer_json=None,
        request="0" * 64,
    )


def prepared(path: Path, **fields) -> DataConfig:
    return DataConfig(name="prepared", path=str(path), **({"seq_len": 8, "heldout": 12} | fields))


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("two")
    write_corpus(path, [(60, 1, 40), (90, 1, 30)])
    return path


def document_of(starts: np.ndarray, position: int) -> int:
    return int(np.searchsorted(starts, position, side="right")) - 1


def example_ranges(dataset, ids) -> list[tuple[int, int]]:
    index = np.asarray(list(ids), dtype=np.int64)
    starts = dataset._starts[index]
    return list(zip(starts.tolist(), (starts + dataset.lengths(index)).tolist(), strict=True))


@pytest.mark.parametrize("examples", ["windows", "documents"])
def test_examples_inside_documents_never_cross_one(two_sources, examples):
    written = corpus.read(two_sources)
    data = build_dataset(prepared(two_sources, examples=examples, window_across_documents=False, max_len=16))
    for i, (begin, end) in enumerate(example_ranges(data, range(data.n_total))):
        d = document_of(written.starts, begin)
        assert written.starts[d] <= begin and end <= written.starts[d + 1], f"id {i} crosses document {d}"
        assert np.array_equal(data.get(i), written.tokens[begin:end])
        if examples == "documents":
            assert begin == written.starts[d] and end - begin == min(written.starts[d + 1] - begin, 17)


def test_windows_across_documents_stay_in_their_source_and_share_one_token(two_sources):
    written = corpus.read(two_sources)
    data = build_dataset(prepared(two_sources))
    bounds = written.starts[written.meta.source_documents]
    sources = data.example_sources(range(data.n_total))
    crossing = 0
    for s, (begin, end) in zip(sources.tolist(), example_ranges(data, range(data.n_total)), strict=True):
        assert end - begin == 9 and bounds[s] <= begin and end <= bounds[s + 1]
        crossing += document_of(written.starts, begin) != document_of(written.starts, end - 1)
    assert crossing > 0  # windows do run from one document into the next


@pytest.mark.parametrize("across", [True, False])
@pytest.mark.parametrize("split", ["iid", "by_source"])
def test_heldout_documents_never_occur_in_training(two_sources, across, split):
    written = corpus.read(two_sources)
    cfg = prepared(two_sources, window_across_documents=across, replica_split=split, heldout=13)
    data = build_dataset(cfg)
    N = data.n_total - cfg.heldout
    ranges = example_ranges(data, range(data.n_total))
    held_docs = {document_of(written.starts, b) for b, _ in ranges[N:]}
    for b, e in ranges[N:]:  # a held-out window lies inside one document
        assert document_of(written.starts, b) == document_of(written.starts, e - 1)
    for b, e in ranges[:N]:
        touched = range(document_of(written.starts, b), document_of(written.starts, e - 1) + 1)
        assert not held_docs & set(touched)
    # held-out id N + j is source j mod S's
    assert data.example_sources(range(N, data.n_total)).tolist() == [j % 2 for j in range(13)]
    assert heldout_per_source(13, 2) == [7, 6]


def test_by_source_interleaves_the_sources_and_drops_the_excess(two_sources):
    data = build_dataset(prepared(two_sources, replica_split="by_source"))
    iid = build_dataset(prepared(two_sources))
    N = data.n_total - 12
    assert N % 2 == 0 and data.example_sources(range(N)).tolist() == [i % 2 for i in range(N)]
    per_source = np.bincount(iid.example_sources(range(iid.n_total - 12)))
    assert N == 2 * per_source.min()
    assert data.fingerprint != iid.fingerprint and data.duplicates == 0
    assert np.array_equal(data._starts[N:], iid._starts[iid.n_total - 12 :])  # the same held-out slice


def test_the_prepared_entry_declares_the_corpus_vocabulary_documents_and_tokenizer(two_sources):
    """What the memory estimate, the preflight and `sample` ask of data=prepared before it is built is
    the corpus's: its meta.json's vocabulary (the dataset's), its documents and sources, its tokenizer."""
    cfg = prepared(two_sources)
    source = data_source(cfg)
    assert source.vocab(cfg) == build_dataset(cfg).vocab == corpus.read_meta(two_sources).vocab
    assert source.own_vocab and source.documents and source.tokenizer == "corpus" and not source.multistream


def test_one_source_gives_one_stream_for_iid_and_by_source(tmp_path):
    write_corpus(tmp_path, [(40, 1, 60)])
    a = build_dataset(prepared(tmp_path))
    b = build_dataset(prepared(tmp_path, replica_split="by_source"))
    assert a.fingerprint == b.fingerprint and a.n_total == b.n_total
    assert np.array_equal(a._starts, b._starts)


def reference_stream(cfg: DataConfig, written: corpus.Corpus) -> list[tuple[int, int]]:
    """The spec (docs/data.md) written plainly, document by document: every stream id's
    (start, length), the held-out ids last."""
    rng, S = np.random.default_rng(cfg.shuffle_seed), len(written.meta.sources)
    bounds, starts = written.meta.source_documents.tolist(), written.starts.tolist()

    def examples(begin: int, end: int) -> list[tuple[int, int]]:
        if cfg.examples == "documents":
            length = min(end - begin, cfg.max_len + 1)
            return [(begin, length)] if length >= 2 else []
        return [(begin + w * cfg.seq_len, cfg.seq_len + 1) for w in range((end - begin - 1) // cfg.seq_len)]

    held, training = [], []
    for s in range(S):
        docs = list(range(bounds[s], bounds[s + 1]))
        out, mine, need = [], [], len(range(s, cfg.heldout, S))
        for d in (docs[i] for i in rng.permutation(len(docs))):
            if len(mine) >= need:
                break
            out.append(d)
            mine += examples(starts[d], starts[d + 1])
        held.append(mine[:need])
        runs = []  # [first, last] documents of each run
        for d in (d for d in docs if d not in out):
            across = cfg.window_across_documents and cfg.examples == "windows"
            if runs and across and runs[-1][1] == d - 1:
                runs[-1][1] = d
            else:
                runs.append([d, d])
        training.append([e for a, b in runs for e in examples(starts[a], starts[b + 1])])
    if cfg.replica_split == "iid":
        pooled = [e for t in training for e in t]
        stream = [pooled[i] for i in rng.permutation(len(pooled))]
    else:
        fewest = min(len(t) for t in training)
        orders = [rng.permutation(len(t)) for t in training]
        stream = [training[i % S][orders[i % S][i // S]] for i in range(S * fewest)]
    return stream + [held[j % S][j // S] for j in range(cfg.heldout)]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"replica_split": "by_source", "shuffle_seed": 3},
        {"window_across_documents": False, "heldout": 5},
        {"examples": "documents", "max_len": 20, "replica_split": "by_source"},
    ],
)
def test_the_stream_is_the_specs_written_plainly(two_sources, fields):
    cfg = prepared(two_sources, **fields)
    data = build_dataset(cfg)
    got = list(zip(data._starts.tolist(), data.lengths(range(data.n_total)).tolist(), strict=True))
    assert got == reference_stream(cfg, corpus.read(two_sources))


def test_a_source_may_owe_no_heldout_example(tmp_path):
    """S = 3 and heldout = 2: sources 0 and 1 give one held-out window each, source 2 none (and keeps
    every document for training)."""
    write_corpus(tmp_path, [(30, 1, 40), (30, 1, 40), (30, 1, 40)])
    cfg = prepared(tmp_path, heldout=2, replica_split="by_source")
    data = build_dataset(cfg)
    assert data.example_sources(range(data.n_total - 2, data.n_total)).tolist() == [0, 1]
    got = list(zip(data._starts.tolist(), data.lengths(range(data.n_total)).tolist(), strict=True))
    assert got == reference_stream(cfg, corpus.read(tmp_path))


def test_a_source_without_heldout_examples_has_no_heldout_loss(tmp_path):
    """Its entry is None (null), the others' recombine to the held-out loss, and W&B gets only theirs."""
    write_corpus(tmp_path, [(30, 1, 40), (30, 1, 40), (30, 1, 40)])
    cfg = compose_cfg(run_args(tmp_path, "data.heldout=2", "data.seq_len=8"))
    run = prepare(cfg)
    loss, figures = heldout_eval(run, initial_weights(run))
    first, second, third = figures["eval_loss_sources"]
    assert third is None and loss == pytest.approx((first + second) / 2, rel=1e-6)
    row = EvalRow(update=0, round=0, eval_loss=loss, eval_loss_sources=[first, second, third])
    assert set(row.wandb()) == {"update", "round", "eval/loss", "eval/loss/source_0", "eval/loss/source_1"}


def test_a_source_short_of_its_heldout_share_is_one_line(tmp_path):
    write_corpus(tmp_path, [(40, 20, 30), (1, 10, 12)])
    with pytest.raises(UserError, match=r"source 1 .*source1.* fewer than the 6 held-out") as error:
        build_dataset(prepared(tmp_path))
    assert "\n" not in str(error.value)


# -- through a run ----------------------------------------------------------------------------------


def run_args(path: Path, *more: str) -> list[str]:
    return [*RUN, "model.d_model=32", "data=prepared", f"data.path={path}", *more]


@pytest.fixture(scope="module")
def run_corpus(tmp_path_factory) -> Path:
    """Two sources of different lengths and alphabets, enough windows of 33 for the quick phase."""
    path = tmp_path_factory.mktemp("corpus")
    write_corpus(path, [(200, 1, 80), (300, 1, 60)])
    return path


def test_by_source_gives_every_replica_its_own_sources_ids(run_corpus, tmp_path):
    """R = 4, S = 2: every id the plan gave replica m in the updates run is an example of source m mod 2,
    read from the run's config and plan facts, against the corpus's own document bounds; the shares
    logged say the same, and each source's held-out loss is on every row holding the held-out loss."""
    run_dir = tmp_path / "run"
    done = entry(
        run_args(run_corpus, "data.replica_split=by_source", "replicas=4", f"hydra.run.dir={run_dir}"),
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    facts = json.loads((run_dir / "plan.json").read_text())
    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert cfg.model.vocab == corpus.BYTES_VOCAB
    data = build_dataset(
        DataConfig(**{k: v for k, v in cfg.data.items() if k in DataConfig.__dataclass_fields__})
    )
    assert data.fingerprint == facts["data/fingerprint"]
    written = corpus.read(run_corpus)
    bounds = written.starts[written.meta.source_documents]
    phase = plan.StrongPhase("p", cfg.phase.offset, cfg.phase.global_batch, cfg.phase.updates)
    tokens = np.zeros((4, 2), dtype=np.int64)
    for u in range(facts["plan/updates_run"]):
        for m in range(4):
            ids = plan.replica_ids(phase, u, m, 4, facts["data/samples"])
            begin = data._starts[ids]
            assert len(ids) and ((bounds[m % 2] <= begin) & (begin + 33 <= bounds[m % 2 + 1])).all()
            tokens[m, m % 2] += 32 * len(ids)
    assert facts["data/source_tokens"] == tokens.tolist() and facts["data/sources"] == ["source0", "source1"]
    assert "replica 3 trains on source0 0.0%, source1 100.0% of its" in (run_dir / "train.log").read_text()
    rows = read_metrics(run_dir / "metrics.jsonl")
    held = [r for r in rows if r.get("eval_loss") is not None]
    assert held and all(len(r["eval_loss_sources"]) == 2 for r in held)
    for r in held:  # 32 held-out windows of each source: the held-out loss is the mean of the two
        assert r["eval_loss"] == pytest.approx(sum(r["eval_loss_sources"]) / 2, rel=1e-6)
    summary = merged_summary(rows)
    assert summary["eval/final_loss_sources"] == held[-1]["eval_loss_sources"]
    assert "tokenizer bytes (vocab 257)" in summary["data/corpus"]
    section, table = data_section([load_run(run_dir)], ["run"])  # the report's Data section
    assert section.table[0] == ["run", "replica", "tokens", "source0", "source1"]
    assert [cells[3:] for cells in section.table[1]] == [["100.0%", "0.0%"], ["0.0%", "100.0%"]] * 2
    assert [row["tokens"] for row in table] == tokens.sum(axis=1).tolist()


def test_one_source_by_source_is_iid_bitwise_through_a_run(tmp_path):
    """S = 1: replica_split=by_source and iid are one stream, so their records and weights are equal."""
    write_corpus(tmp_path / "one", [(300, 1, 80)])
    runs = {}
    for split in ("iid", "by_source"):
        runs[split] = tmp_path / split
        args = run_args(tmp_path / "one", f"data.replica_split={split}", f"hydra.run.dir={runs[split]}")
        done = entry(args, tmp_path)
        assert done.returncode == 0, done.stderr
    assert_identical(runs["by_source"], runs["iid"])
    rows = read_metrics(runs["iid"] / "metrics.jsonl")
    assert not any("eval_loss_sources" in r for r in rows)  # one source: no split of the held-out loss


def test_a_killed_prepared_run_resumed_equals_the_uninterrupted_run(run_corpus, tmp_path):
    """Invariant 9 on a prepared corpus of two sources, replica_split=by_source (about 4 s)."""
    args = run_args(run_corpus, "data.replica_split=by_source", "inner.H=2", "phase.updates=8")
    args += ["checkpoint.every=1"]
    run_dir, reference = killed_beside_uninterrupted(args, tmp_path, "0:5:kill")
    resumed(args, run_dir, tmp_path)
    assert_identical(run_dir, reference)
    got = [r.get("eval_loss_sources") for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "sync"]
    want = [
        r.get("eval_loss_sources") for r in read_metrics(reference / "metrics.jsonl") if r["kind"] == "sync"
    ]
    assert got == want and all(got)


# -- the corpus's files against its meta.json (issue 48) ----------------------------------------------


def later(path: Path) -> None:
    """`path`'s mtime made later than its stamp's, as an edit or a copy leaves it: a test writes within
    one tick of the file system's coarse clock (a few ms), where the mtime may not move; a user's
    edit of a prepared corpus comes later than that."""
    recorded = corpus.read_meta(path.parent).stamps[path.name]
    status = path.stat()
    if status.st_mtime_ns == recorded[1]:
        os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 1))


def rewrite_tokens(directory: Path, fraction: float) -> int:
    """`fraction` of tokens.bin's ids (one at least) changed in place to another id below the `bytes`
    vocabulary, the file's size kept (issue 48's edit): how many."""
    path = directory / corpus.TOKENS
    tokens = np.fromfile(path, dtype="<u2")
    count = max(1, round(fraction * len(tokens)))
    at = np.random.default_rng(1).choice(len(tokens), count, replace=False)
    tokens[at] = (tokens[at] + 1) % corpus.BYTES_EOD
    with open(path, "r+b") as file:
        file.write(tokens.tobytes())
    later(path)
    return count


def without_stamps(directory: Path) -> None:
    """The meta.json of a corpus prepared before the stamps and the largest id were recorded."""
    raw = json.loads((directory / corpus.META).read_text())
    del raw["stamps"], raw["max_id"]
    (directory / corpus.META).write_text(json.dumps(raw, indent=1) + "\n")


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The names of the corpus files hashed from here on (`corpus.sha256_file`), in order."""
    names, real = [], corpus.sha256_file

    def counted(path, dtype=None):
        names.append(Path(path).name)
        return real(path, dtype)

    monkeypatch.setattr(corpus, "sha256_file", counted)
    return names


def test_a_corpus_as_written_is_read_unhashed_and_one_changed_id_is_refused(tmp_path, hashed):
    """The stamps (size, mtime_ns) recorded when the files were written hold: nothing is hashed. One id
    changed in place (the size kept): its stamp differs, the hash runs and differs, one line."""
    write_corpus(tmp_path, [(60, 1, 40)])
    hashed.clear()
    build_dataset(prepared(tmp_path))
    assert hashed == []
    assert rewrite_tokens(tmp_path, 0) == 1
    with pytest.raises(UserError) as error:
        build_dataset(prepared(tmp_path))
    assert str(error.value) == (
        f"{tmp_path}: tokens.bin changed after it was prepared (its sha256 is not meta.json's "
        f"tokens_sha256); {corpus.prepare_again(tmp_path)}"
    )
    assert hashed == [corpus.TOKENS]


def test_a_corpus_copied_without_its_times_is_hashed_once_and_trains(run_corpus, tmp_path, hashed):
    """`cp -r` (no -p) gives the files new mtimes: the run hashes both files once, finds the bytes
    meta.json records and trains."""
    copy = tmp_path / "copy"
    shutil.copytree(run_corpus, copy, copy_function=shutil.copyfile)  # contents only, as cp without -p
    for name in (corpus.TOKENS, corpus.DOCUMENTS):
        later(copy / name)
    hashed.clear()
    done = entry(run_args(copy, "phase.updates=2", f"hydra.run.dir={tmp_path / 'run'}"), tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(hashed) == [corpus.DOCUMENTS, corpus.TOKENS]


def test_a_corpus_from_before_the_stamps_is_hashed_and_its_largest_id_read(tmp_path, hashed):
    """No stamps, no max_id: both files hashed at each read, the largest id taken from the same pass
    (the test's own maximum of the ids); a changed id is refused as with stamps."""
    write_corpus(tmp_path, [(60, 1, 40), (30, 1, 40)])
    without_stamps(tmp_path)
    largest = int(np.fromfile(tmp_path / corpus.TOKENS, dtype="<u2").max())
    hashed.clear()
    assert corpus.verify(tmp_path, corpus.read_meta(tmp_path)) == largest == corpus.BYTES_EOD
    assert hashed == [corpus.TOKENS, corpus.DOCUMENTS]
    tokens = np.fromfile(tmp_path / corpus.TOKENS, dtype="<u2")
    tokens[7] = (tokens[7] + 1) % corpus.BYTES_EOD  # the size kept; no stamp: no mtime needed to see it
    tokens.tofile(tmp_path / corpus.TOKENS)
    with pytest.raises(UserError, match=r"tokens.bin changed after it was prepared"):
        build_dataset(prepared(tmp_path))


@pytest.mark.parametrize("stamped", [True, False], ids=["max-id-recorded", "max-id-hashed"])
def test_an_id_at_or_above_the_vocabulary_is_refused_at_start(tmp_path, stamped):
    """A corpus written with id 300 under vocab 257 (the embedding has no row 300: an IndexError
    mid-run): refused when its dataset is built, from the meta's max_id or from the hash's pass."""
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 256, 30) for _ in range(40)]
    documents[17][5] = 300
    corpus.write(
        tmp_path,
        [documents],
        [corpus.SourceMeta("s", 1, 0, 0, "0" * 64)],
        vocab=corpus.BYTES_VOCAB,
        eod=corpus.BYTES_EOD,
        tokenizer="bytes",
        tokenizer_json=None,
        request="0" * 64,
    )
    if not stamped:
        without_stamps(tmp_path)
    with pytest.raises(UserError) as error:
        build_dataset(prepared(tmp_path))
    assert str(error.value).startswith(f"{tmp_path}: tokens.bin holds id 300, at or above its vocab 257 ")


def test_a_truncated_corpus_gets_one_advice_from_training_and_prepare_that_works(tmp_path):
    """tokens.bin cut by one id: training and prepare (which said "nothing to do") give the same line's
    advice, and following it (remove, prepare again) gives a corpus a run reads."""
    text = "some text to prepare. " * 300
    (tmp_path / "docs.txt").write_text(text)
    out = tmp_path / "corpus"
    args = ["prepare", str(tmp_path / "docs.txt"), "--out", str(out), "--quiet"]
    assert data_command(args, tmp_path).returncode == 0
    tokens = out / corpus.TOKENS
    tokens.write_bytes(tokens.read_bytes()[:-2])
    said = []
    for done in (
        entry(run_args(out, f"hydra.run.dir={tmp_path / 'run'}"), tmp_path),
        data_command(args, tmp_path),
    ):
        assert done.returncode == 2 and error_lines(done.stderr) == stderr_lines(done.stderr), done.stderr
        said += error_lines(done.stderr)
    size = 2 * corpus.read_meta(out).tokens
    assert (
        said
        == [
            f"hypertrain: error: {out}: tokens.bin holds {size - 2:,} bytes where its meta.json says "
            f"{size:,} ({len(text) + 1:,} tokens, 1 documents); {corpus.prepare_again(out)}"
        ]
        * 2
    )
    assert not (tmp_path / "run").exists()
    shutil.rmtree(out)
    assert data_command(args, tmp_path).returncode == 0
    assert corpus.read(out).tokens.tolist() == [*text.encode(), corpus.BYTES_EOD]


@pytest.mark.slow
def test_a_corpus_changed_under_a_killed_run_is_refused_when_it_resumes(run_corpus, tmp_path):
    """Issue 48's reproduction: a data=prepared run killed, 0.5% of tokens.bin rewritten in place (the
    same size, ids below the vocabulary), resume=auto: one line naming the corpus, exit 2, the run's
    directory as it was (about 6 s)."""
    mine = tmp_path / "corpus"
    shutil.copytree(run_corpus, mine)  # copy2: the mtimes, so the stamps, kept
    meta = corpus.read_meta(mine)
    assert all(corpus.stamp(mine / name) == stamp for name, stamp in meta.stamps.items())
    args = run_args(
        mine, "inner.H=2", "phase.updates=8", "checkpoint.every=1", f"hydra.run.dir={tmp_path / 'run'}"
    )
    assert entry(args, tmp_path, "0:5:kill").returncode == KILLED
    assert rewrite_tokens(mine, 0.005) == round(0.005 * meta.tokens)
    before = tree(tmp_path / "run")
    done = entry([*args, "resume=auto"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert stderr_lines(done.stderr) == [
        f"hypertrain: error: {mine}: tokens.bin changed after it was prepared (its sha256 is not meta.json's "
        f"tokens_sha256); {corpus.prepare_again(mine)}"
    ]
    assert tree(tmp_path / "run") == before
