"""Speech data (data=speech): espeak-ng speech of real text, aligned text tokens and residual-VQ codes.

Small builds (300 sentences of a few stdlib modules' docstrings and comments, 4 codebooks of 64) run
end to end through the same command the training entry starts (`python -m hypertrain.data.speech build`).
The checks read espeak-ng's own events and recompute the log-mel by replaying the synthesis, so they
test the stored data against its sources, not against numbers the build wrote down:
- every word's text tokens lie inside the frames its phonemes were spoken in (events read here, with
  this file's own reading of them), and the tokens decode back to the sentence;
- the codes, decoded, reproduce the replayed log-mel with the mean squared error the build reports;
- two builds of the same inputs give the same examples; a changed input gives a new build, the same
  inputs reuse the old one; a missing espeak-ng library is one line, exit 2.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hypertrain.config import DataConfig, TrainConfig, UserError
from hypertrain.data import data_source
from hypertrain.data.datasets import MultistreamDataset
from hypertrain.data.speech import cache, synth
from hypertrain.data.speech import dataset as speech
from hypertrain.data.speech.speech import PHONEME
from hypertrain.preflight.checks import validate

SOURCE_MODULES = ["asyncio/base_events.py", "asyncio/events.py", "asyncio/tasks.py", "asyncio/streams.py"]
FRAME_MS = 80.0
# Reordered float64 sums of N non-negative terms differ by at most N * u (u = 2^-53) of the sum
# (Higham, "Accuracy and Stability of Numerical Algorithms", 4.2); N = frames x bins < 2^20 here.
SUM_REORDERED = 2**20 * 2.0**-53


def small_config(root: Path, **changes) -> DataConfig:
    cfg = DataConfig(
        name="speech",
        path=str(root / "source" / "*.py"),
        speech_sentences=300,
        codebooks=4,
        codebook_size=64,
        quantizer_frames=4096,
        text_vocab=512,
        heldout=16,
        cache_dir=str(root / "cache"),
    )
    return replace(cfg, **changes)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A text source of its own (copies of stdlib modules), so a test may change it."""
    root = tmp_path_factory.mktemp("speech")
    (root / "source").mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in SOURCE_MODULES:
        shutil.copy(stdlib / name, root / "source" / Path(name).name)
    return root


@pytest.fixture(scope="module")
def built(root) -> speech.SpeechDataset:
    return speech.speech_dataset(small_config(root))


@pytest.fixture(scope="module")
def replayed(built) -> dict[str, tuple]:
    """Each spoken sentence's (log-mel, events), synthesised again exactly as the build spoke them."""
    inputs = built.manifest["inputs"]
    spoken = (built.directory / cache.SPOKEN).read_text().splitlines()
    out = synth.speak_blocks(spoken, inputs["voice"], inputs["rate"], inputs["mel_bins"], 2, events=True)
    return {sentence: (mel, events) for sentence, (mel, _, events) in zip(spoken, out, strict=True)}


def spoken_frames(sentence: str, events: np.ndarray, frames: int) -> list[tuple[int, int] | None]:
    """Per word: the first and last frame overlapping the time espeak-ng spent on its phonemes.

    This file's reading of the events: a phoneme belongs to the word its character position falls in
    (or, for a position between words, the next word), lasts until the next phoneme event (the last
    one until the last event), and pause phonemes ("_", "_:", ...) belong to no word. Frame t
    stands for [80t - 40, 80t + 40) ms. None for a word espeak-ng spoke no phoneme of.
    """
    words = [m.span() for m in re.finditer(r"\S+", sentence)]
    phonemes = [e for e in events.tolist() if e[0] == PHONEME]
    end_ms = int(events["ms"].max())  # the last event (the final END) is at the end of the audio
    spans: list[list[float] | None] = [None] * len(words)
    for j, (_, position, _, ms, name) in enumerate(phonemes):
        if name.startswith(b"_"):
            continue
        until = phonemes[j + 1][3] if j + 1 < len(phonemes) else end_ms
        word = next((i for i, (a, b) in enumerate(words) if position < b), len(words) - 1)
        span = spans[word]
        spans[word] = [ms, until] if span is None else [min(span[0], ms), max(span[1], until)]
    out = []
    for span in spans:
        if span is None:
            out.append(None)
            continue
        first = math.floor((span[0] + FRAME_MS / 2) / FRAME_MS)
        last = math.ceil((span[1] + FRAME_MS / 2) / FRAME_MS) - 1
        out.append((min(first, frames - 1), min(max(first, last), frames - 1)))
    return out


def words_outside_their_frames(dataset, sentence: str, row: np.ndarray, spoken: list) -> list[str]:
    """The words whose tokens in the text channel `row` lie outside their spoken frames (a word
    without phonemes rides on the spoken word before it, or on the first spoken one when it leads)."""
    words = sentence.split()
    carrier = []
    for j in range(len(words)):
        before = [i for i in range(j + 1) if spoken[i] is not None]
        carrier.append(spoken[before[-1]] if before else next(s for s in spoken if s is not None))
    placed = [(p - 1, int(t)) for p, t in enumerate(row.tolist()) if t > 1]  # frame p - 1; not PAD/END
    bad, at = [], 0
    for word, (first, last) in zip(words, carrier, strict=True):
        count = len(dataset.tokenizer.encode(" " + word, add_special_tokens=False).ids)
        mine = placed[at : at + count]
        at += count
        inside = all(first <= frame <= last for frame, _ in mine)
        if dataset.decode_text(t for _, t in mine) != " " + word or not inside:
            bad.append(word)
    return bad + (["(tokens after the last word)"] if at < len(placed) else [])


def test_a_small_build_gives_multistream_examples_with_the_seeds_channel_counts(built):
    d = built
    figures = d.manifest["figures"]
    assert d.n_total == figures["examples"] > d.manifest["inputs"]["codebooks"]
    assert figures["examples"] + figures["dropped_unaligned"] == figures["sentences_spoken"] == 300
    K = d.manifest["inputs"]["codebooks"]
    assert d.channels == 1 + K and d.channel_vocabs == (512,) + (64,) * K
    assert d.channel_scales == (1.0,) + (32.0 / K,) * K  # docs/design.md "Loss weights": 1, 32 / K
    ids = np.arange(d.n_total)
    frames = d.frames(ids)
    assert frames.sum() == figures["frames"]
    counts = d.channel_counts(ids)
    for i in ids.tolist():
        row = d.get(i)
        T = int(frames[i])
        assert row.shape == (1 + K, T + 2) and row.dtype == np.int64 and d.lengths([i])[0] == T + 2
        assert (row[:, 0] == -1).all()  # the start position holds no token
        assert row[0, T + 1] == 1 and (row[0, 1 : T + 1] != 1).all()  # one END, after the last frame
        assert row[1, T + 1] == -1 and (row[2:, 1] == -1).all()  # codebook 1 aligned, 2..K one later
        assert np.array_equal(counts[i], (row[:, 1:] >= 0).sum(1))  # targets: tokens after position 0
        assert ((row[1:, 1:] < 64) & (row[0] < 512)[None, 1:]).all()
        assert d.decode_text(row[0]) == " " + d.sentence(i)  # the text channel is the sentence
    # The seed's dynamic_weights counts frames + samples for the text, frames for each codebook.
    assert counts[:, 0].sum() == frames.sum() + d.n_total and (counts[:, 1:].sum(0) == frames.sum()).all()
    assert np.array_equal(d.get_many([3, 1])[1, :, : d.lengths([1])[0]], d.get(1))


def test_the_speech_entry_declares_the_channels_and_lengths_its_dataset_has(root, built):
    """What the memory estimate, the preflight and the engines ask of data=speech before it is built
    is what the build gives: its channels' vocabularies, examples of their own lengths."""
    cfg = small_config(root)
    source = data_source(cfg)
    assert source.multistream and isinstance(built, MultistreamDataset)
    assert source.channel_vocabs(cfg) == list(built.channel_vocabs) == [512] + [64] * 4
    assert source.variable_length(cfg) and not built.fixed_length
    assert source.longest(cfg) is None and source.tokenizer == ""  # no bound in the config; not text alone


def test_the_delay_shifts_codebooks_2_to_k_only(built):
    undelayed = speech.load(built.directory, replace(small_config(Path("/unused")), audio_delay=0))
    assert undelayed.fingerprint != built.fingerprint  # the same cache, another layout
    for i in range(0, built.n_total, 17):
        T = int(built.frames([i])[0])
        a, b = undelayed.get(i), built.get(i)
        assert np.array_equal(a[:2], b[:2])
        assert np.array_equal(a[2:, 1 : T + 1], b[2:, 2 : T + 2])


def test_every_word_lies_inside_the_frames_espeak_spoke_it(built, replayed):
    checked = 0
    for i in range(built.n_total):
        sentence = built.sentence(i)
        mel, events = replayed[sentence]
        row = built.get(i)[0]
        T = int(built.frames([i])[0])
        assert len(mel) == T
        spoken = spoken_frames(sentence, events, T)
        assert words_outside_their_frames(built, sentence, row, spoken) == []
        checked += len(spoken)
        if i < 10:  # the check can fail: the same tokens three frames later leave some word's frames
            late = np.full_like(row, 0)
            late[4:] = row[1:-3]
            assert words_outside_their_frames(built, sentence, late[: len(row)], spoken)
    assert checked == built.manifest["figures"]["words"]


def test_the_codes_reconstruct_the_log_mel_within_the_reported_error(built, replayed):
    sums, count, wrong = 0.0, 0, 0.0
    for i in range(built.n_total):
        mel = replayed[built.sentence(i)][0].astype(np.float64)
        decoded = built.log_mel(i)  # from the stored codes, through get's layout below
        row = built.get(i)
        T = len(mel)
        codes = np.stack([row[1, 1 : T + 1]] + [row[k, 2 : T + 2] for k in range(2, built.channels)], 1)
        assert np.array_equal(built.quantizer.decode(codes), decoded)
        sums += np.square(mel - decoded).sum()
        count += mel.size
        unshifted = np.stack([row[1, 1 : T + 1]] + [row[k, 1 : T + 1] for k in range(2, built.channels)], 1)
        wrong += np.square(mel - built.quantizer.decode(np.maximum(unshifted, 0))).sum()
    reported = built.manifest["figures"]["error_db2_by_stages"]
    assert count < 2**20
    assert abs(sums / count - reported[-1]) <= SUM_REORDERED * reported[-1]
    assert reported[-1] < reported[0]  # the codes carry the frames: below their variance
    assert wrong / count > reported[-1] * (1 + SUM_REORDERED)  # codes read without the delay: worse


@pytest.mark.slow
def test_the_same_inputs_build_the_same_examples(root, built):
    again = small_config(root, cache_dir=str(root / "second_cache"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hypertrain.data.speech",
            "build",
            *(f"{k}={v}" for k, v in vars(again).items()),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "hours" in done.stdout and "perplexity" in done.stdout and "variance" in done.stdout
    second = speech.load(Path(again.cache_dir) / built.directory.name, small_config(root))
    assert second.directory != built.directory
    assert second.fingerprint == built.fingerprint
    for i in range(second.n_total):
        assert np.array_equal(second.get(i), built.get(i))


@pytest.mark.slow
def test_the_cache_is_reused_and_rebuilt_when_an_input_changes(root, built, monkeypatch):
    base = small_config(root)
    assert cache.recipe(base).directory == built.directory
    same = [{"audio_delay": 0}, {"heldout": 8}, {"shuffle_seed": 3}, {"max_examples": 4}]
    for change in same:  # applied when reading: the same build
        assert cache.recipe(replace(base, **change)).key == cache.recipe(base).key, change
    inputs = [
        {"speech_voice": "en"},
        {"speech_rate": 180},
        {"speech_sentences": 299},
        {"speech_max_words": 20},
        {"speech_seed": 1},
        {"mel_bins": 64},
        {"codebooks": 3},
        {"codebook_size": 65},
        {"quantizer_frames": 4097},
        {"text_vocab": 513},
    ]
    for change in inputs:
        assert cache.recipe(replace(base, **change)).key != cache.recipe(base).key, change

    def no_build(cfg):
        raise AssertionError("rebuilt although the inputs did not change")

    monkeypatch.setattr(speech, "run_build", no_build)
    assert speech.speech_dataset(base).fingerprint == built.fingerprint
    monkeypatch.undo()

    # The text changes (a copy of the source with one more sentence): built anew, the first build kept.
    shutil.copytree(root / "source", root / "changed")
    with open(root / "changed" / "events.py", "a") as file:
        file.write("\n# The source changed after the first build, so its speech is built again.\n")
    changed = speech.speech_dataset(replace(base, path=str(root / "changed" / "*.py")))
    assert changed.directory != built.directory and cache.is_built(built.directory)
    found = changed.manifest["figures"]["sentences_found"]
    assert found == built.manifest["figures"]["sentences_found"] + 1


def test_a_missing_espeak_library_is_one_line_exit_2(root, monkeypatch):
    env = {"ESPEAK_NG_LIBRARY": str(root / "no" / "libespeak-ng.so.1"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "hypertrain.data.speech", "build", f"cache_dir={root / 'unused'}"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hypertrain: error: espeak-ng's library"), done.stderr
    assert lines[0].endswith("install it: apt-get install espeak-ng libespeak-ng1")
    monkeypatch.setenv("ESPEAK_NG_LIBRARY", env["ESPEAK_NG_LIBRARY"])
    with pytest.raises(UserError, match="apt-get install espeak-ng libespeak-ng1"):
        speech.speech_dataset(small_config(root))


def test_the_build_command_reads_back_every_field_the_training_entry_hands_it():
    from hypertrain.data.speech.__main__ import parse_config

    for cfg in (DataConfig(name="speech"), small_config(Path("/x y"), speech_voice="en+m3", audio_delay=0)):
        assert parse_config([f"{k}={v}" for k, v in vars(cfg).items()]) == cfg  # as run_build writes them


def test_training_the_byte_decoder_on_speech_is_refused():
    with pytest.raises(UserError, match="multistream"):
        validate(TrainConfig(data=DataConfig(name="speech")))


SAMPLED = 2048  # chosen sentences spoken here: 8 blocks of synth.BLOCK (~10 s on 2 cores)
FALSE_PASS = 1e-4  # the most probability that a default build too short to hold the stream passes


@pytest.mark.slow  # the source's sentences, the tokenizer and 2048 sentences spoken (~20 s)
def test_the_default_build_holds_the_seeds_stream_and_the_held_out_slice():
    """The default build (17,000 sentences) keeps at least 16,384 + heldout utterances; a sentence is
    dropped when a word's tokens do not fit its frames (build.py). Without the full build (~3 min):
    the build's own selection and tokenizer, then a seeded uniform sample of SAMPLED chosen sentences
    spoken and aligned as the build does. If the population held D >= D_MIN drops (too few kept),
    the sample would show at most the drops seen with hypergeometric probability P(X <= d) <=
    P(X <= d | D_MIN) (it falls as D grows), asserted <= FALSE_PASS. The one assumption: a sentence's
    drop does not depend on the sentences espeak-ng spoke before it in its block."""
    from scipy.stats import hypergeom

    from hypertrain.data.speech import align, corpus, text
    from hypertrain.data.speech.build import _sample

    cfg = DataConfig(name="speech")
    recipe = cache.recipe(cfg)
    with synth.pool(synth.workers()) as parse_pool:
        found = corpus.sentences(
            recipe.source, cfg.speech_max_words, lambda f, *a: parse_pool.starmap(f, zip(*a, strict=True), 16)
        )
    chosen = _sample(found.texts, cfg.speech_sentences, cfg.speech_seed)
    assert len(chosen) == cfg.speech_sentences == 17000
    tokens = text.word_tokens(text.fit(chosen, cfg.text_vocab), [s.split() for s in chosen])
    picked = np.sort(np.random.default_rng(2024).choice(len(chosen), SAMPLED, replace=False)).tolist()
    spoken = synth.speak_blocks(
        [chosen[i] for i in picked], cfg.speech_voice, cfg.speech_rate, cfg.mel_bins, synth.workers()
    )
    dropped = sum(
        align.place_tokens(align.frame_spans(spans, len(frames)), [len(w) for w in tokens[i]], len(frames))
        is None
        for (frames, spans), i in zip(spoken, picked, strict=True)
    )
    d_min = len(chosen) - (16384 + cfg.heldout) + 1  # this many drops would leave one utterance short
    chance = hypergeom.cdf(dropped, len(chosen), d_min, SAMPLED)
    print(f"{dropped} of {SAMPLED} sampled sentences dropped; P(so few | {d_min} drops) = {chance:.2g}")
    assert chance <= FALSE_PASS


# -- voices espeak-ng does not list, and the build lock (issue 21) ---------------------------------


def build_command(tmp_path: Path, *fields: str) -> subprocess.CompletedProcess:
    """`python -m hypertrain.data.speech build FIELDS` with the cache under tmp_path/cache."""
    return subprocess.run(
        [sys.executable, "-m", "hypertrain.data.speech", "build", f"cache_dir={tmp_path / 'cache'}", *fields],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("voice", "why"),
    [
        ("zz-nope", "('zz-nope' is not a voice espeak-ng lists)"),
        # espeak-ng itself takes this one: it sets en-us without a variant and reports success.
        ("en-us+zz", "(the variant 'zz' is not one espeak-ng lists)"),
    ],
)
def test_a_voice_espeak_ng_does_not_list_is_one_line_exit_2_and_creates_nothing(tmp_path, voice, why):
    done = build_command(tmp_path, f"speech_voice={voice}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"hypertrain: error: data.speech_voice={voice!r} is not an espeak-ng voice {why}; valid: a "
        "language, name or file `espeak-ng --voices` lists, e.g. 'en-us', optionally +a variant "
        "`espeak-ng --voices=variant` lists, e.g. 'en-us+m3'"
    ]
    assert not (tmp_path / "cache").exists()


def test_a_build_that_fails_under_its_lock_leaves_no_lock_file(tmp_path):
    (tmp_path / "source.txt").write_text("Only one short sentence here.\n")  # spoken, then too few frames
    done = build_command(tmp_path, f"path={tmp_path / 'source.txt'}")
    assert done.returncode == 2, done.stderr
    assert "frames cannot fit data.codebook_size=1024 centroids" in done.stderr  # after the speech
    assert list((tmp_path / "cache").iterdir()) == []  # neither the lock file nor a staging directory


def test_the_build_lock_excludes_a_second_builder_and_leaves_no_file(tmp_path):
    import threading

    directory = tmp_path / "cache" / "0123456789abcdef"
    holder = subprocess.Popen(  # another process (another rank, another user's command) holds it
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from hypertrain.data.speech.cache import build_lock\n"
            f"with build_lock(Path({str(directory)!r})):\n"
            "    print('held', flush=True); sys.stdin.readline()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        entered = threading.Event()

        def second() -> None:
            with cache.build_lock(directory):
                entered.set()

        waiter = threading.Thread(target=second)
        waiter.start()
        # A lock that did not exclude would let the thread in within milliseconds; one that does
        # never lets it in while the holder waits for its stdin, so this wait cannot pass by luck.
        assert not entered.wait(1.0), "the build lock let a second builder in while held"
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(60) == 0
        waiter.join(60)
        assert entered.is_set(), "the second builder never got the lock its holder gave up"
    finally:
        holder.kill()
    with pytest.raises(ValueError), cache.build_lock(directory):
        raise ValueError("a build that fails")
    assert list((tmp_path / "cache").iterdir()) == []  # the lock file went with each holder
