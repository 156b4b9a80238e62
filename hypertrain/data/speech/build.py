"""Build a speech dataset once into its cache directory: text, speech, log-mel, aligned tokens, codes.

`build(recipe, directory)` runs the steps of docs/audio.md ("How it is made") in a temporary directory
renamed into place at the end, so a cache directory is complete or absent. It forks the synthesis, so
it runs where the main module is light (`python -m hypertrain.data.speech build`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hypertrain.data.speech import align, cache, codes, corpus, synth, text
from hypertrain.data.speech.features import FRAME_RATE

_PARSE_CHUNK = 16  # source files per task when extracting sentences in parallel


def build(recipe: cache.Recipe, directory: Path, progress: bool | None = None) -> dict:
    """Build the dataset `recipe` describes into `directory` (replaced only if absent); its manifest.

    `progress`: a progress bar on stderr (None: only when stderr is a terminal).
    """
    from tqdm import tqdm

    started = time.perf_counter()
    seconds: dict[str, float] = {}

    def lap(step: str) -> None:
        seconds[step] = time.perf_counter() - started - sum(seconds.values())

    cfg = recipe.cfg
    source = recipe.source
    processes = synth.workers()
    bar = tqdm(total=1, unit="step", disable=None if progress is None else not progress, file=sys.stderr)
    bar.set_description("sentences")
    found, chosen = _choose(recipe, processes)
    lap("sentences")
    bar.update()
    bar.reset(total=len(chosen))
    bar.unit = "sentence"
    bar.set_description("speech")
    spoken = synth.speak_blocks(
        chosen, cfg.speech_voice, cfg.speech_rate, cfg.mel_bins, processes, on_block=bar.update
    )
    lap("speech")
    bar.set_description("tokens")
    tokenizer = text.fit(chosen, cfg.text_vocab)
    word_lists = [sentence.split() for sentence in chosen]
    tokens = text.word_tokens(tokenizer, word_lists)
    kept, rows = _align_rows(spoken, tokens)
    lap("tokens")
    mel = np.concatenate([spoken[i][0] for i in kept])
    frames_per_example = np.array([len(r) for r in rows], dtype=np.int64)
    del spoken
    bar.reset(total=cfg.codebooks)
    bar.unit = "stage"
    bar.set_description("quantiser")
    if len(mel) < cfg.codebook_size:
        raise cache.BuildError(
            f"{len(mel)} frames cannot fit data.codebook_size={cfg.codebook_size} centroids; "
            "valid: a smaller codebook or more sentences"
        )
    quantizer, all_codes = codes.fit_and_encode(
        mel, cfg.codebooks, cfg.codebook_size, cfg.quantizer_frames, cfg.speech_seed, bar.update
    )
    errors = codes.errors(quantizer, mel, all_codes)
    usage = codes.usage(all_codes, cfg.codebook_size)
    lap("quantiser")
    bar.close()

    figures = _figures(source.label, found, chosen, word_lists, kept, rows, frames_per_example, errors, usage)
    figures["step_seconds"] = seconds  # laps still to come ("write") land in it
    figures["processes"] = processes
    staging = Path(tempfile.mkdtemp(prefix=directory.name + ".building-", dir=directory.parent))
    try:
        _save_arrays(staging, rows, all_codes, frames_per_example, kept, chosen, quantizer, tokenizer)
        lap("write")
        figures["build_seconds"] = time.perf_counter() - started
        manifest = {
            "inputs": recipe.inputs,
            "key": recipe.key,
            "content_sha256": cache.content_digest(staging),
            "figures": figures,
        }
        (staging / cache.MANIFEST).write_text(json.dumps(manifest, indent=1))
        _publish(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return read_manifest(directory)


def _choose(recipe: cache.Recipe, processes: int) -> tuple[corpus.Sentences, list[str]]:
    """The source's prose sentences (parsed on `processes` workers) and the recipe's seeded sample of them."""
    cfg, source = recipe.cfg, recipe.source
    with synth.pool(processes) as parse_pool:
        found = corpus.sentences(
            source,
            cfg.speech_max_words,
            lambda f, *a: parse_pool.starmap(f, zip(*a, strict=True), _PARSE_CHUNK),
        )
    chosen = _sample(found.texts, cfg.speech_sentences, cfg.speech_seed)
    if not chosen:
        raise cache.BuildError(
            f"{source.label}: no prose sentence to speak; valid: English sentences of at least "
            f"{corpus.MIN_WORDS} words (docs/audio.md: the filter)"
        )
    return found, chosen


def _align_rows(spoken: list, tokens: list) -> tuple[list[int], list[np.ndarray]]:
    """The indices of the sentences whose tokens fit their frames, and each one's frame-aligned token row."""
    kept, rows = [], []
    for i, ((frames, spans), word_ids) in enumerate(zip(spoken, tokens, strict=True)):
        ranges = align.frame_spans(spans, len(frames))
        positions = align.place_tokens(ranges, [len(w) for w in word_ids], len(frames))
        if positions is None:
            continue
        row = np.full(len(frames), text.PAD, dtype=np.uint16)
        for start, ids in zip(positions.tolist(), word_ids, strict=True):
            row[start : start + len(ids)] = ids
        kept.append(i)
        rows.append(row)
    if not kept:
        raise cache.BuildError("no sentence could be aligned")
    return kept, rows


def _figures(label, found, chosen, word_lists, kept, rows, frames_per_example, errors, usage) -> dict:
    """The manifest's figures of a build up to build_seconds (None: filled by `build`), in their order."""
    return {
        "source": label,
        "sentences_found": len(found.texts),
        "duplicate_sentences": found.duplicates,
        "unparsed_files": found.unparsed,
        "sentences_spoken": len(chosen),
        "dropped_unaligned": len(chosen) - len(kept),
        "examples": len(kept),
        "frames": int(frames_per_example.sum()),
        "hours": float(frames_per_example.sum() / FRAME_RATE / 3600),
        "words": int(sum(len(word_lists[i]) for i in kept)),
        "text_tokens": int(sum(int((r != text.PAD).sum()) for r in rows)),
        "frames_min_mean_max": [
            int(frames_per_example.min()),
            float(frames_per_example.mean()),
            int(frames_per_example.max()),
        ],
        "error_db2_by_stages": errors,
        "codebook_usage": usage,
        "build_seconds": None,
    }


def _save_arrays(
    staging: Path, rows, all_codes, frames_per_example, kept, chosen, quantizer, tokenizer
) -> None:
    """Write the build's arrays, spoken sentences, quantiser and tokenizer into `staging`."""
    np.save(staging / cache.TEXT, np.concatenate(rows))
    np.save(staging / cache.CODES, all_codes)
    np.save(staging / cache.FRAMES, frames_per_example)
    np.save(staging / cache.KEPT, np.array(kept, dtype=np.int64))
    (staging / cache.SPOKEN).write_text("".join(s + "\n" for s in chosen))
    np.save(staging / cache.QUANTIZER_MEAN, quantizer.mean)
    np.save(staging / cache.QUANTIZER_CODEBOOKS, quantizer.codebooks)
    tokenizer.save(str(staging / cache.TOKENIZER))


def _publish(staging: Path, directory: Path) -> None:
    """Rename the finished `staging` to `directory`, readable by all; keeps another process's build."""
    os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide a shared cache from its other users
    try:
        os.rename(staging, directory)
    except OSError:  # another process finished the same build first: keep theirs
        if not (directory / cache.MANIFEST).exists():
            raise


def read_manifest(directory: Path) -> dict:
    return json.loads((directory / cache.MANIFEST).read_text())


def _sample(sentences: list[str], count: int, seed: int) -> list[str]:
    """`count` sentences (0: all) drawn without replacement with `seed`, kept in source order."""
    if not count or count >= len(sentences):
        return list(sentences)
    chosen = np.sort(np.random.default_rng(seed).choice(len(sentences), size=count, replace=False))
    return [sentences[i] for i in chosen.tolist()]


def summary(manifest: dict, directory: Path) -> str:
    """What was built, for the terminal: the figures the manifest holds."""
    f, inputs = manifest["figures"], manifest["inputs"]
    low, mean, high = f["frames_min_mean_max"]
    errors = f["error_db2_by_stages"]
    lines = [
        f"speech dataset {directory}",
        f"  text        {f['source']}: {f['sentences_found']:,} distinct prose sentences "
        f"({f['duplicate_sentences']:,} repeats, {f['unparsed_files']} unparsed files); "
        f"{f['sentences_spoken']:,} spoken",
        f"  speech      espeak-ng {inputs['espeak_ng']} voice {inputs['voice']} at {inputs['rate']} wpm: "
        f"{f['hours']:.2f} hours, {f['examples']:,} examples "
        f"({f['dropped_unaligned']} dropped: a word's tokens did not fit its spoken frames)",
        f"  frames      {f['frames']:,} at {FRAME_RATE} per second, {low}..{high} per example "
        f"(mean {mean:.1f}); "
        f"{f['words']:,} words, {f['text_tokens']:,} text tokens",
        f"  quantiser   {inputs['codebooks']} stages x {inputs['codebook_size']} entries on "
        f"{inputs['mel_bins']} log-mel bins; squared error per bin (dB^2): "
        f"{errors[0]:.2f} (the variance) -> {errors[1]:.2f} after stage 1 -> {errors[-1]:.3f} after "
        f"{len(errors) - 1} ({errors[-1] / errors[0]:.1%} of the variance left)",
        "  stage       " + "  ".join(f"{k + 1:>6}" for k in range(len(f["codebook_usage"]))),
        "  used        " + "  ".join(f"{u['used']:>6.1%}" for u in f["codebook_usage"]),
        "  perplexity  " + "  ".join(f"{u['perplexity']:>6.0f}" for u in f["codebook_usage"]),
        f"  built in {f['build_seconds']:.0f} s with {f['processes']} processes ("
        + ", ".join(f"{step} {t:.0f} s" for step, t in f["step_seconds"].items())
        + ")",
    ]
    return "\n".join(lines)
