"""Speech as data (data=speech): espeak-ng speech of real text as multistream token examples.

`dataset.speech_dataset(cfg)` is what `data.build_dataset` returns for `data.name == "speech"`: the
examples of a cache directory built once by `python -m hypertrain.data.speech build` (`build.py`), keyed
by its inputs (`cache.py`). The pieces: `corpus` (the sentences), `speech` (espeak-ng via ctypes),
`synth` (speech and frames in fresh processes), `features` (log-mel), `align` (words onto frames),
`text` (the text channel's BPE), `codes` (the residual VQ). docs/audio.md has the whole story.
Importing this package imports nothing heavy; reading a built dataset needs numpy only.
"""
