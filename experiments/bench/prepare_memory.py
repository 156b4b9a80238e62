"""Peak memory of `python -m hypertrain.data prepare` on one long document, beside the same text as many.

About --mb MB of text (the running Python's standard-library `.py` files, as experiments/bench/prepare.py
writes them) is prepared twice with one tokenizer.json (a byte-level BPE of 4096 tokens that prepare
trained on a 2 MB sample), each in a child process whose peak resident memory (os.wait4's ru_maxrss)
is printed, in MB and in bytes per character: (1) the text as its files, each a document (batches of
about 4 M characters: inputs.BATCH_CHARS); (2) the same text as one document. Prepare encodes a long
document in pieces (bpe.pieces), so (2) should take about what (1) takes, not the ~190 bytes a
character of one encode_batch call over the whole document.

`--vocab V ...` prints instead the address space tokenizers' BpeTrainer reserves for a vocabulary of V
(VmPeak of a child process that trains a byte-level BPE of V tokens on one sentence): what bounds
prepare's train:V.

    .venv/bin/python experiments/bench/prepare_memory.py [--mb 50]
    .venv/bin/python experiments/bench/prepare_memory.py --vocab 1000000 10000000 100000000
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_prepare", Path(__file__).with_name("prepare.py"))
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)  # its source_texts, write_documents and trained_tokenizer


def peak(inputs: str, out: Path, tokenizer: Path) -> tuple[float, float]:
    """(peak resident MB, seconds) of one prepare in a child process."""
    command = [sys.executable, "-m", "hypertrain.data", "prepare", inputs, "--out", str(out)]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    child = subprocess.Popen([*command, "--tokenizer", str(tokenizer), "--quiet"], env=env)
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"prepare failed: exit {os.waitstatus_to_exitcode(status)}")
    return usage.ru_maxrss / 1024, time.perf_counter() - start  # ru_maxrss: KiB on Linux


# A child process: a BPE of V tokens trained on one sentence, then its peak address space (VmPeak).
TRAINER = """
import sys
from hypertrain.data.bpe import byte_level_bpe
byte_level_bpe(["the trainer reserves its vocabulary before it reads a word"], int(sys.argv[1]), ["<eod>"])
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmPeak")))
"""


def reserved(vocabularies: list[int]) -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    empty = int(subprocess.run([sys.executable, "-c", TRAINER, "300"], env=env, capture_output=True,
                               text=True, check=True).stdout)  # fmt: skip
    print("VmPeak of a byte-level BPE trained on one sentence, less that of V = 300:")
    for vocab in vocabularies:
        done = subprocess.run(
            [sys.executable, "-c", TRAINER, str(vocab)], env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            print(f"    V = {vocab:>13,}: the trainer failed (exit {done.returncode})")
            continue
        kib = int(done.stdout) - empty  # /proc's kB are KiB
        print(f"    V = {vocab:>13,}: {kib / 2**20:7.2f} GiB, {kib * 1024 / vocab:5.1f} bytes a token")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=50.0, help="megabytes of text")
    parser.add_argument("--vocab", type=int, nargs="+", help="only the trainer's reservation for these V")
    args = parser.parse_args()
    if args.vocab:
        reserved(args.vocab)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-prepare-memory-") as temporary:
        root = Path(temporary)
        documents = bench.write_documents(root / "docs", args.mb)
        text = "".join(documents)
        (root / "one").mkdir()
        (root / "one" / "long.txt").write_text(text)
        tokenizer = bench.trained_tokenizer(root)
        print(f"text: {len(text):,} characters, {len(documents):,} files; peak resident memory of prepare:")
        for name, inputs in (("as its files", root / "docs" / "*.txt"), ("one document", root / "one" / "*")):
            megabytes, seconds = peak(str(inputs), root / f"corpus-{name.split()[0]}", tokenizer)
            per_char = megabytes * 2**20 / len(text)
            print(f"    {name:<13} {megabytes:8.0f} MB  {per_char:6.1f} bytes/character  ({seconds:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
