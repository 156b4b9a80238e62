"""The synthesis, in fresh processes: sentences in, log-mel frames and each word's spoken interval out.

`speak_blocks` speaks fixed blocks of `BLOCK` sentences, each in a process forked from a server that
never loaded espeak-ng (which carries state between utterances), so the result depends on the
sentences and their order only (docs/audio.md, "How it is made").
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable

from hypertrain.data.speech import align, features
from hypertrain.data.speech.speech import Speaker

BLOCK = 256  # sentences one fresh process speaks in order (part of the cache key)


def workers() -> int:
    """Processes to use: the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pool(processes: int, fresh: bool = False):
    """A process pool forked from a server that preloaded the synthesis modules (not the library).

    `fresh`: each task gets a process of its own (espeak-ng's initial state).
    """
    context = multiprocessing.get_context("forkserver")
    # Preloaded once in the server, so each forked process starts without importing them again.
    context.set_forkserver_preload(
        [
            "hypertrain.data.speech.synth",
            "hypertrain.data.speech.corpus",
            "librosa.filters",
            "scipy.signal",
            "threadpoolctl",
        ]
    )
    return context.Pool(processes, maxtasksperchild=1 if fresh else None)


def speak_blocks(
    sentences: list[str],
    voice: str,
    rate: int,
    mel_bins: int,
    processes: int,
    events: bool = False,
    on_block: Callable[[int], None] = lambda n: None,
) -> list[tuple]:
    """Per sentence, in order: (log-mel float32 [T, mel_bins], word intervals int64 [n_words, 2] in ms),
    plus espeak-ng's events (a structured array, `speech.Utterance.events`) when `events`.

    `on_block(n)` is called as each block of n sentences is done.
    """
    blocks = [
        (sentences[i : i + BLOCK], voice, rate, mel_bins, events) for i in range(0, len(sentences), BLOCK)
    ]
    out: list[tuple] = []
    if not blocks:
        return out
    with pool(min(processes, len(blocks)), fresh=True) as workers_pool:
        for result in workers_pool.imap(_speak_block, blocks):
            out += result
            on_block(len(result))
    return out


def _speak_block(task: tuple) -> list[tuple]:
    from threadpoolctl import threadpool_limits

    sentences, voice, rate, mel_bins, keep_events = task
    speaker = Speaker(voice, rate)  # this process's first: the library's initial state
    out = []
    with threadpool_limits(1):  # one process per core already
        for sentence in sentences:
            utterance = speaker.speak(sentence)
            duration_ms = 1000.0 * len(utterance.samples) / speaker.sample_rate
            frames = features.log_mel(utterance.samples, speaker.sample_rate, mel_bins)
            spans = align.word_spans(sentence, utterance.events, duration_ms)
            out.append((frames, spans, utterance.events) if keep_events else (frames, spans))
    return out
