"""Datasets: ids give fixed, real, shuffled examples; errors are one line naming the value."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hypertrain.config import ConfigError, DataConfig
from hypertrain.data import Dataset, build_dataset, load_batch, pad_batch

REPO = Path(__file__).resolve().parents[1]


def stdlib_reference_bytes() -> tuple[bytes, list[bytes]]:
    """The stdlib corpus read independently of data.py: every .py file outside site/dist-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [
        p
        for p in root.rglob("*.py")
        if not any("site-packages" in part or "dist-packages" in part for part in p.relative_to(root).parts)
    ]
    files = [p.read_bytes() for p in sorted(paths, key=lambda p: p.relative_to(root).as_posix())]
    return b"".join(files), files


@pytest.fixture(scope="module")
def stdlib() -> Dataset:
    return build_dataset(DataConfig(name="stdlib", seq_len=64, shuffle_seed=0))


@pytest.fixture(scope="module")
def stdlib_reference() -> tuple[bytes, list[bytes]]:
    return stdlib_reference_bytes()


def write_random_text(folder: Path, sizes: dict[str, int], seed: int = 0) -> dict[str, bytes]:
    """Files of random letters and paragraph breaks; long windows of them are unique."""
    rng = np.random.default_rng(seed)
    alphabet = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz \n", dtype=np.uint8)
    written = {}
    for name, size in sizes.items():
        data = alphabet[rng.integers(0, len(alphabet), size)].tobytes()
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
        written[name] = data
    return written


def test_stdlib_rows_are_fixed_windows_of_seq_len_plus_one(stdlib):
    assert stdlib.vocab == 256 and stdlib.fixed_length and stdlib.max_length == 65
    for i in (0, 1, 12345, stdlib.n_total - 1):
        row = stdlib.get(i)
        assert row.dtype == np.int64 and row.shape == (65,)
        assert row.min() >= 0 and row.max() < 256
        np.testing.assert_array_equal(row, stdlib.get(i))
        row[:] = -1  # a returned row is a copy: writing to it leaves the dataset unchanged
        assert stdlib.get(i).min() >= 0
    np.testing.assert_array_equal(stdlib.lengths([0, 5, 9]), [65, 65, 65])
    assert "stdlib" in stdlib.description and f"{stdlib.n_total:,} windows of 65" in stdlib.description


def test_stdlib_rows_are_the_shuffled_windows_of_the_stdlib_bytes(stdlib, stdlib_reference):
    corpus, files = stdlib_reference
    T = 64
    assert stdlib.n_total == (len(corpus) - 1) // T
    order = np.random.default_rng(0).permutation(stdlib.n_total)
    for i in (0, 7, 1000, stdlib.n_total - 256, stdlib.n_total - 1):
        w = order[i]
        assert bytes(stdlib.get(i).astype(np.uint8)) == corpus[w * T : w * T + T + 1]
    # And as text: some early row is a stretch of one real stdlib file.
    texts = [bytes(stdlib.get(i).astype(np.uint8)) for i in range(20)]
    assert any(any(text in f for f in files) for text in texts)


def test_stream_order_is_a_permutation_covering_every_window_once(tmp_path):
    written = write_random_text(tmp_path, {"a.txt": 3000, "b/c.txt": 2001})
    corpus = written["a.txt"] + written["b/c.txt"]
    T = 10
    data = build_dataset(DataConfig(name="text_files", path=str(tmp_path / "**/*.txt"), seq_len=T, heldout=8))
    windows = {corpus[w * T : w * T + T + 1]: w for w in range((len(corpus) - 1) // T)}
    assert len(windows) == data.n_total  # random text: every window is distinct
    seen = [windows[bytes(row.astype(np.uint8))] for row in data.get_many(range(data.n_total))]
    assert sorted(seen) == list(range(data.n_total))
    assert seen != sorted(seen)  # shuffled, not in file order


def test_heldout_ids_never_share_an_example_with_training_ids(tmp_path):
    # By construction: id i is window perm[i] of a permutation, so the last `heldout` ids hold
    # windows no training id (0 .. n_total - heldout - 1) holds.
    write_random_text(tmp_path, {"x.txt": 4000})
    cfg = DataConfig(name="text_files", path=str(tmp_path / "x.txt"), seq_len=16, heldout=30)
    data = build_dataset(cfg)
    n_train = data.n_total - cfg.heldout
    train = {bytes(r.astype(np.uint8)) for r in data.get_many(range(n_train))}
    heldout = {bytes(r.astype(np.uint8)) for r in data.get_many(range(n_train, data.n_total))}
    assert len(heldout) == cfg.heldout and not train & heldout


def test_fingerprint_is_stable_and_follows_the_settings(stdlib):
    again = build_dataset(DataConfig(name="stdlib", seq_len=64, shuffle_seed=0))
    assert again.fingerprint == stdlib.fingerprint and len(stdlib.fingerprint) == 64
    np.testing.assert_array_equal(again.get_many(range(100)), stdlib.get_many(range(100)))
    assert build_dataset(DataConfig(name="stdlib", seq_len=32)).fingerprint != stdlib.fingerprint
    assert build_dataset(DataConfig(name="stdlib", shuffle_seed=1)).fingerprint != stdlib.fingerprint
    # heldout chooses ids, not examples: it leaves the fingerprint alone.
    assert build_dataset(DataConfig(name="stdlib", heldout=7)).fingerprint == stdlib.fingerprint


def test_same_config_gives_the_same_rows_in_another_process(stdlib):
    code = (
        "import hashlib\n"
        "from hypertrain.config import DataConfig\n"
        "from hypertrain.data import build_dataset\n"
        "d = build_dataset(DataConfig(name='stdlib', seq_len=64, shuffle_seed=0))\n"
        "print(d.fingerprint, hashlib.sha256(d.get_many(range(0, d.n_total, 997)).tobytes()).hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    rows = stdlib.get_many(range(0, stdlib.n_total, 997))
    assert out.stdout.split() == [stdlib.fingerprint, hashlib.sha256(rows.tobytes()).hexdigest()]


def test_text_files_reads_the_glob_in_sorted_order(tmp_path):
    written = write_random_text(tmp_path, {"b.txt": 500, "a.txt": 400, "sub/c.txt": 300, "skip.md": 200})
    cfg = DataConfig(name="text_files", path=str(tmp_path / "**" / "*.txt"), seq_len=8, heldout=4)
    data = build_dataset(cfg)
    corpus = written["a.txt"] + written["b.txt"] + written["sub/c.txt"]
    assert data.vocab == 256 and data.n_total == (len(corpus) - 1) // 8
    order = np.random.default_rng(0).permutation(data.n_total)
    for i in range(data.n_total):
        w = order[i]
        assert bytes(data.get(i).astype(np.uint8)) == corpus[w * 8 : w * 8 + 9]
    assert "3 files" in data.description
    # Names are taken relative to the files' folder: the same files elsewhere keep the fingerprint.
    moved = tmp_path / "elsewhere"
    for name, content in written.items():
        (moved / name).parent.mkdir(parents=True, exist_ok=True)
        (moved / name).write_bytes(content)
    cfg_moved = DataConfig(name="text_files", path=str(moved / "**" / "*.txt"), seq_len=8, heldout=4)
    assert build_dataset(cfg_moved).fingerprint == data.fingerprint


@pytest.mark.parametrize("token_dtype,largest", [("uint16", 50256), ("uint32", 100_000)])
def test_token_bin_windows_of_a_memory_mapped_file(tmp_path, token_dtype, largest):
    path = tmp_path / "train.bin"
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, largest, 2001).astype(token_dtype)
    tokens[123] = largest
    stored = np.memmap(path, dtype=token_dtype, mode="w+", shape=tokens.shape)
    stored[:] = tokens
    stored.flush()
    del stored
    cfg = DataConfig(name="token_bin", path=str(path), token_dtype=token_dtype, seq_len=20, heldout=10)
    data = build_dataset(cfg)
    assert data.vocab == largest + 1
    assert data.n_total == 2000 // 20
    order = np.random.default_rng(0).permutation(data.n_total)
    batch = load_batch(data.get, range(data.n_total))
    assert batch.dtype == torch.int64 and batch.shape == (data.n_total, 21)
    for i in range(data.n_total):
        w = order[i]
        np.testing.assert_array_equal(batch[i].numpy(), tokens[w * 20 : w * 20 + 21].astype(np.int64))
        np.testing.assert_array_equal(data.get(i), batch[i].numpy())
    assert token_dtype in data.description


def test_documents_are_paragraphs_cut_at_max_len_plus_one(tmp_path):
    paragraphs = [b"short one", b"x", b"", b"a" * 50, b"b" * 7 + b"\nline two", b"last\n"]
    (tmp_path / "doc.txt").write_bytes(b"\n\n".join(paragraphs[:4]))
    (tmp_path / "more.txt").write_bytes(b"\n\n".join(paragraphs[4:]))
    cfg = DataConfig(
        name="text_files", path=str(tmp_path / "*.txt"), examples="documents", max_len=15, heldout=1
    )
    data = build_dataset(cfg)
    expected = sorted(p[:16] for p in paragraphs if len(p[:16]) >= 2)
    rows = [bytes(data.get(i).astype(np.uint8)) for i in range(data.n_total)]
    assert sorted(rows) == expected
    assert not data.fixed_length and data.max_length == 16


def test_stdlib_documents_vary_in_length_and_lengths_agree_with_rows():
    data = build_dataset(DataConfig(name="stdlib", examples="documents", max_len=100))
    ids = np.arange(0, data.n_total, 101)
    lengths = data.lengths(ids)
    assert lengths.dtype == np.int64
    assert lengths.min() >= 2 and lengths.max() <= 101 and len(set(lengths.tolist())) > 10
    assert [len(data.get(int(i))) for i in ids] == lengths.tolist()
    assert "paragraphs" in data.description
    with pytest.raises(ValueError, match="get_many needs fixed-length"):
        data.get_many(ids)


def test_load_batch_takes_any_sample_fn_and_rejects_ragged_rows(stdlib):
    ids = [5, 3, 99, 3]
    fast = load_batch(stdlib.get, ids)
    assert fast.dtype == torch.int64 and fast.shape == (4, 65)
    torch.testing.assert_close(load_batch(stdlib, ids), fast)
    torch.testing.assert_close(load_batch(lambda i: stdlib.get(i), ids), fast)
    torch.testing.assert_close(fast[1], fast[3])
    assert load_batch(stdlib.get, []).shape == (0, 65)
    with pytest.raises(ValueError, match="pad_batch"):
        load_batch(lambda i: np.arange(i + 2), [0, 1])


def test_pad_batch_pads_with_zero_and_masks_real_positions():
    rows = [np.array([7, 8, 9]), np.array([4]), np.array([1, 2, 3, 4, 5])]
    tokens, mask = pad_batch(rows)
    assert tokens.dtype == torch.int64 and mask.dtype == torch.bool and tokens.shape == (3, 5)
    assert tokens.tolist() == [[7, 8, 9, 0, 0], [4, 0, 0, 0, 0], [1, 2, 3, 4, 5]]
    assert mask.sum(1).tolist() == [3, 1, 5]
    assert mask.tolist()[0] == [True, True, True, False, False]
    wide_tokens, wide_mask = pad_batch(rows, length=8)
    assert wide_tokens.shape == (3, 8) and wide_mask.sum().item() == 9
    assert pad_batch([])[0].shape == (0, 0)
    with pytest.raises(ValueError, match="length=4"):
        pad_batch(rows, length=4)


def test_ids_outside_the_stream_raise(stdlib):
    for bad in (-1, stdlib.n_total):
        with pytest.raises(IndexError, match=str(bad)):
            stdlib.get(bad)
        with pytest.raises(IndexError, match=str(bad)):
            stdlib.get_many([0, bad])


def test_empty_glob_is_a_one_line_config_error(tmp_path):
    glob = str(tmp_path / "nothing" / "**" / "*.txt")
    with pytest.raises(ConfigError, match="matches no files") as error:
        build_dataset(DataConfig(name="text_files", path=glob))
    assert glob in str(error.value) and "\n" not in str(error.value)


def test_missing_or_ragged_token_file_is_a_one_line_config_error(tmp_path):
    missing = str(tmp_path / "absent.bin")
    with pytest.raises(ConfigError, match="is not a file") as error:
        build_dataset(DataConfig(name="token_bin", path=missing))
    assert missing in str(error.value) and "\n" not in str(error.value)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ConfigError, match="3 bytes"):
        build_dataset(DataConfig(name="token_bin", path=str(odd)))
    with pytest.raises(ConfigError, match="documents"):
        build_dataset(DataConfig(name="token_bin", path=str(odd), examples="documents"))


def test_stream_not_longer_than_heldout_is_a_config_error(tmp_path):
    (tmp_path / "tiny.txt").write_bytes(b"x" * 641)  # (641 - 1) // 64 = 10 windows
    cfg = DataConfig(name="text_files", path=str(tmp_path / "tiny.txt"), seq_len=64, heldout=10)
    with pytest.raises(ConfigError, match="data.heldout=10") as error:
        build_dataset(cfg)
    assert "gives 10 windows" in str(error.value) and "\n" not in str(error.value)
    cfg.heldout = 9
    assert build_dataset(cfg).n_total == 10
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ConfigError, match="gives 0 windows"):
        build_dataset(DataConfig(name="text_files", path=str(tmp_path / "empty.txt")))


def test_building_the_stdlib_dataset_is_fast():
    start = time.perf_counter()
    build_dataset(DataConfig(name="stdlib"))
    assert time.perf_counter() - start < 5.0  # ~0.25 s measured; generous for slow CI machines
