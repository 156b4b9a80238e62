"""docs/data.md's example of prepare's end line: this Python's standard-library `email` package and `json`
package prepared with a trained BPE (train:2048), then the same command again (nothing to do).

Runs `python -m hypertrain.data prepare 'email/**/*.py' 'json/*.py' --out DIR --tokenizer train:2048` twice
in the standard library's folder, DIR a temporary `corpora/mine`, and prints both end lines with DIR as
`corpora/mine` (the page's). experiments/check_docs.py (table prepare-example) compares them with the
page's, but for the seconds and tokens/s.

    .venv/bin/python experiments/prepare_example.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INPUTS = ("email/**/*.py", "json/*.py")
TOKENIZER = "train:2048"


def main() -> int:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="prepare-example-") as temporary:
        out = Path(temporary) / "corpora" / "mine"
        command = [sys.executable, "-m", "hypertrain.data", "prepare", *INPUTS, "--out", str(out)]
        for _ in range(2):
            done = subprocess.run(
                [*command, "--tokenizer", TOKENIZER],
                cwd=sysconfig.get_paths()["stdlib"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            print(done.stdout.strip().replace(str(out), "corpora/mine"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
