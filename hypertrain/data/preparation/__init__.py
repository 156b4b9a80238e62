"""`python -m hypertrain.data prepare`: its inputs (`inputs`), the tokenizing into a corpus
(`prepare`), the place it is written (`outdir`) under a lock beside it (`lockfile`), whole or not at
all.
"""
