"""Speech as data (data=speech): espeak-ng speech of real text as multistream token examples.

`dataset.speech_dataset(cfg)` reads the cache `python -m hypertrain.data.speech build` makes once;
docs/audio.md says which module does each step. Importing this package imports nothing heavy.
"""
