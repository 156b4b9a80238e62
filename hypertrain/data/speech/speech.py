"""espeak-ng through ctypes: text in, 16-bit mono audio and the library's timed events out.

`Speaker(voice, rate).speak(text)` gives an `Utterance` (the samples, every event of the synthesis),
the same for the same text, voice, rate and library. The library holds global state: one `Speaker`
per process. A missing library raises `EspeakMissing`, one line naming how to install it.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np

from hypertrain.config import UserError

LIBRARY = "libespeak-ng.so.1"
INSTALL = "apt-get install espeak-ng libespeak-ng1"

# speak_lib.h (espeak-ng 1.49-1.52): the constants and the event struct of the legacy API.
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_PHONEME_EVENTS = 1  # options bit 0: report espeakEVENT_PHONEME
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_RATE = 1  # espeak_PARAMETER espeakRATE, words per minute
_BUFFER_MS = 500  # audio handed to the callback at a time

LIST_TERMINATED, WORD, SENTENCE, MARK, PLAY, END, MSG_TERMINATED, PHONEME, SAMPLERATE = range(9)


class EspeakMissing(UserError):
    """espeak-ng's library cannot be loaded or initialised."""


class _EventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _Event(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),  # 1-based, in characters of the text
        ("length", ctypes.c_int),  # characters of the word (WORD events)
        ("audio_position", ctypes.c_int),  # ms from the start of the synthesised speech
        ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p),
        ("id", _EventId),
    ]


_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event)
)
# The fields copied out of each event, as one numpy record (ints in the struct's own layout).
_EVENT_DTYPE = np.dtype(
    {
        "names": ["type", "text_position", "length", "audio_position", "name"],
        "formats": ["<i4", "<i4", "<i4", "<i4", "S8"],
        "offsets": [
            _Event.type.offset,
            _Event.text_position.offset,
            _Event.length.offset,
            _Event.audio_position.offset,
            _Event.id.offset,
        ],
        "itemsize": ctypes.sizeof(_Event),
    }
)


@dataclass(frozen=True)
class Utterance:
    """One synthesis: `samples` int16 [n] at the speaker's rate; `events` in the order reported.

    `events` is a structured array: `type` (WORD, PHONEME, END, ...), `position` (0-based character
    index into the text), `length` (characters, WORD events), `ms` (time in the audio), `name` (the
    phoneme's mnemonic, PHONEME events; empty otherwise).
    """

    samples: np.ndarray
    events: np.ndarray


def library_path() -> str:
    """The library to load: `$ESPEAK_NG_LIBRARY` when set, else libespeak-ng.so.1 from the loader's path."""
    return os.environ.get("ESPEAK_NG_LIBRARY") or LIBRARY


class _Voice(ctypes.Structure):
    """speak_lib.h's espeak_VOICE: `languages` is a run of (priority byte, name, NUL), then a 0 byte."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("languages", ctypes.c_void_p),
        ("identifier", ctypes.c_char_p),
        ("gender", ctypes.c_ubyte),
        ("age", ctypes.c_ubyte),
        ("variant", ctypes.c_ubyte),
        ("xx1", ctypes.c_ubyte),
        ("score", ctypes.c_int),
        ("spare", ctypes.c_void_p),
    ]


def _languages(address: int) -> list[str]:
    out = []
    while ctypes.string_at(address, 1) != b"\0":  # the priority byte; 0 ends the list
        name = ctypes.string_at(address + 1)
        out.append(name.decode())
        address += len(name) + 2
    return out


def listed_voices(lib, kind: str | None = None) -> tuple[set[str], set[str]]:
    """(languages and names, files) of the voices espeak-ng lists, as `espeak-ng --voices` does
    (`kind="variant"`: the variants, as `--voices=variant`). Languages and names are lower case (the
    library matches them so); a file is a path under espeak-ng's voices folder."""
    lib.espeak_ListVoices.restype = ctypes.POINTER(ctypes.POINTER(_Voice))
    lib.espeak_ListVoices.argtypes = [ctypes.POINTER(_Voice)]
    spec = None
    if kind is not None:
        wanted = ctypes.create_string_buffer(kind.encode())
        spec = ctypes.pointer(_Voice(languages=ctypes.cast(wanted, ctypes.c_void_p).value))
    voices = lib.espeak_ListVoices(spec)
    words, files, i = set(), set(), 0
    while voices[i]:
        voice = voices[i].contents
        words |= {voice.name.decode().lower(), *(x.lower() for x in _languages(voice.languages))}
        files.add(voice.identifier.decode())
        i += 1
    return words, files


def unlisted_voice(lib, voice: str) -> str | None:
    """Why espeak-ng would speak `voice` with a fallback: the part of `voice` (`base` or
    `base+variant`) it does not list, said as a clause; None when it lists both. espeak-ng sets an
    unknown variant's voice without one and reports success (`espeak_SetVoiceByName("en-us+zz")`)."""
    base, plus, variant = voice.partition("+")
    words, files = listed_voices(lib)
    if base.lower() not in words and base not in files:
        return f" ({base!r} is not a voice espeak-ng lists)"
    if plus:
        _, variant_files = listed_voices(lib, "variant")
        if variant not in {f.rpartition("/")[2] for f in variant_files}:
            return f" (the variant {variant!r} is not one espeak-ng lists)"
    return None


class Speaker:
    """espeak-ng in this process, set to one voice and rate; `speak(text)` synthesises."""

    def __init__(self, voice: str, rate: int) -> None:
        path = library_path()
        try:
            lib = ctypes.CDLL(path)
        except OSError as error:
            reason = str(error).split(":")[-1].strip() or "cannot be loaded"
            raise EspeakMissing(
                f"espeak-ng's library {path} cannot be loaded ({reason}); data=speech synthesises its "
                f"speech with it; install it: {INSTALL}"
            ) from None
        lib.espeak_Info.restype = ctypes.c_char_p
        lib.espeak_Info.argtypes = [ctypes.c_void_p]
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_CALLBACK]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        self.version = lib.espeak_Info(None).decode()
        self.sample_rate = lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, _BUFFER_MS, None, _INITIALIZE_PHONEME_EVENTS
        )
        if self.sample_rate <= 0:
            raise EspeakMissing(
                f"espeak-ng's library {path} loaded but found no voice data; install it: {INSTALL}"
            )
        unlisted = unlisted_voice(lib, voice)
        if unlisted is not None or lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise UserError(
                f"data.speech_voice={voice!r} is not an espeak-ng voice{unlisted or ''}; valid: a language, "
                "name or file `espeak-ng --voices` lists, e.g. 'en-us', optionally +a variant "
                "`espeak-ng --voices=variant` lists, e.g. 'en-us+m3'"
            )
        if lib.espeak_SetParameter(_RATE, rate, 0) != 0:
            raise UserError(
                f"data.speech_rate={rate} is refused by espeak-ng; valid: 80..450 words per minute"
            )
        self.voice, self.rate = voice, rate
        self._lib = lib
        self._audio: list[bytes] = []
        self._events: list[bytes] = []
        self._callback = _CALLBACK(self._receive)  # kept alive as long as the speaker
        lib.espeak_SetSynthCallback(self._callback)

    def _receive(self, wav, count, events) -> int:
        if count > 0:
            self._audio.append(ctypes.string_at(wav, count * 2))
        n = 0
        while events[n].type != LIST_TERMINATED:
            n += 1
        if n:
            self._events.append(ctypes.string_at(events, n * ctypes.sizeof(_Event)))
        return 0  # go on synthesising

    def speak(self, text: str) -> Utterance:
        """The speech of `text` (one utterance, spoken to its end) with its events."""
        self._audio, self._events = [], []
        data = text.encode()
        status = self._lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        if status != 0:
            raise RuntimeError(f"espeak_Synth failed with status {status} on {text[:60]!r}")
        samples = np.frombuffer(b"".join(self._audio), dtype="<i2").copy()
        raw = np.frombuffer(b"".join(self._events), dtype=_EVENT_DTYPE)
        events = np.empty(len(raw), dtype=EVENT_DTYPE)
        events["type"] = raw["type"]
        events["position"] = raw["text_position"] - 1
        events["length"] = raw["length"]
        events["ms"] = raw["audio_position"]
        # A phoneme's mnemonic ends at its first zero byte (the rest of the 8 bytes is not cleared).
        names = [name.split(b"\0", 1)[0] for name in raw["name"].tolist()]
        events["name"] = np.where(raw["type"] == PHONEME, np.array(names, dtype="S8"), b"")
        return Utterance(samples, events)


EVENT_DTYPE = np.dtype(
    [("type", "<i4"), ("position", "<i4"), ("length", "<i4"), ("ms", "<i4"), ("name", "S8")]
)
