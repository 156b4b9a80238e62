"""A run on a prepared corpus learns (issue 38): a byte-level BPE of 512 tokens trained by
`python -m hypertrain.data prepare` on the standard library's docstrings, then the default job
(`python -m hypertrain.train data=prepared data.path=DIR`, its default number of updates) ends with a
held-out loss below the unigram entropy of the corpus's tokens (docs/data.md).

Why that bound: a model that learned no context, only how often each token occurs, predicts every
target with the same distribution q, and its expected loss on held-out tokens drawn from the corpus's
distribution p is the cross-entropy H(p, q) = H(p) + KL(p || q) >= H(p), the unigram entropy. Below
H(p), the run predicts from context: it has learnt more than the tokens' frequencies. The entropy is
computed here from the corpus's own tokens (numpy, float64), eod included since the run's targets
include it; the held-out slice is whole documents of the same docstrings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import data_command, entry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from tuned_study import stdlib_docstrings  # noqa: E402  (the one extraction, the tuned study's corpus too)

from hypertrain.data import corpus
from hypertrain.records.files import merged_summary, read_metrics

MEGABYTES = 2.5  # of docstrings: 40 updates of 256 windows of 65 tokens need ~0.66 M tokens (~2 MB)


def unigram_entropy(tokens: np.ndarray, vocab: int) -> float:
    """H(p) in nats of the tokens' empirical distribution."""
    p = np.bincount(tokens.astype(np.int64), minlength=vocab).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


@pytest.mark.slow  # the default job: 40 updates of 4 replicas, and a BPE trained (~20 s here)
def test_a_run_on_a_bpe_corpus_of_docstrings_ends_below_the_unigram_entropy(tmp_path):
    texts = stdlib_docstrings(MEGABYTES)
    inputs = tmp_path / "docstrings.jsonl"
    inputs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    made = data_command(["prepare", str(inputs), "--tokenizer", "train:512", "--out", "corpus"], tmp_path)
    assert made.returncode == 0, made.stderr
    written = corpus.read(tmp_path / "corpus")
    assert written.meta.vocab <= 512 and written.meta.documents == len(texts)
    entropy = unigram_entropy(np.asarray(written.tokens), written.meta.vocab)

    run_dir = tmp_path / "run"
    args = ["data=prepared", "data.path=corpus", "logger=none", f"hydra.run.dir={run_dir}"]
    done = entry(args, tmp_path)
    assert done.returncode == 0, done.stderr
    rows = read_metrics(run_dir / "metrics.jsonl")
    final = merged_summary(rows)["eval/final_loss"]
    first = next(r for r in rows if r.get("eval_loss") is not None)["eval_loss"]
    facts = json.loads((run_dir / "plan.json").read_text())
    assert facts["plan/updates_run"] == 40, "the default job's number of updates"
    print(f"held-out loss {first:.3f} first, {final:.3f} final; unigram entropy {entropy:.3f} nats/token")
    assert first > entropy, "the bound must be one the run had to learn its way below"
    assert final < entropy, f"held-out loss {final:.3f} is not below the unigram entropy {entropy:.3f}"
