"""The codecs' kernels (docs/compression.md): the block codecs' encode/decode (`kernels`), which
`hypertrain.codec_table`'s entries pick, and the geometry of their blocks (`chunks`, `tiles`). Pure
tensor functions of the config's codec fields; nothing of a run.
"""
