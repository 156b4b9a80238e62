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

from hypertrain.config import DataConfig, UserError
from hypertrain.data import build_dataset, data_source
from hypertrain.data import text as data_module
from hypertrain.data.datasets import MultistreamDataset
from hypertrain.data.text import TextDataset, load_batch, pad_batch

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
def stdlib() -> TextDataset:
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


def distinct_windows(corpus: bytes, T: int) -> list[bytes]:
    """The spec, by content: every window of `corpus`, each content once, in order of first occurrence."""
    return list(dict.fromkeys(corpus[w * T : w * T + T + 1] for w in range((len(corpus) - 1) // T)))


def distinct_paragraphs(files: list[bytes], cut: int) -> list[bytes]:
    """The spec, by content: paragraphs cut at `cut`, of >= 2 bytes, each content once, first first."""
    cut_paragraphs = (p[:cut] for f in files for p in f.split(b"\n\n"))
    return list(dict.fromkeys(p for p in cut_paragraphs if len(p) >= 2))


def contents(data: TextDataset, ids) -> list[bytes]:
    return [bytes(data.get(int(i)).astype(np.uint8)) for i in ids]


def assert_heldout_unseen_in_training(data: TextDataset, heldout: int) -> None:
    """No held-out example's tokens equal any training example's, and no two ids hold equal tokens."""
    rows = [data.get(i).tobytes() for i in range(data.n_total)]  # int64 bytes: equal rows, equal bytes
    training, held = set(rows[: data.n_total - heldout]), rows[data.n_total - heldout :]
    assert [i for i, row in enumerate(held) if row in training] == []
    assert len(set(rows)) == data.n_total


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


def test_stdlib_rows_are_the_shuffled_distinct_windows_of_the_stdlib_bytes(stdlib, stdlib_reference):
    corpus, files = stdlib_reference
    T = 64
    distinct = distinct_windows(corpus, T)
    dropped = (len(corpus) - 1) // T - len(distinct)
    assert stdlib.n_total == len(distinct) and stdlib.duplicates == dropped > 0
    assert f"{len(distinct):,} windows of 65 ({dropped:,} duplicates dropped)" in stdlib.description
    order = np.random.default_rng(0).permutation(stdlib.n_total)
    for i in (0, 7, 1000, stdlib.n_total - 256, stdlib.n_total - 1):
        assert bytes(stdlib.get(i).astype(np.uint8)) == distinct[order[i]]
    # And as text: some early row is a stretch of one real stdlib file.
    texts = [bytes(stdlib.get(i).astype(np.uint8)) for i in range(20)]
    assert any(any(text in f for f in files) for text in texts)


@pytest.mark.parametrize("examples", ["windows", "documents"])
def test_no_heldout_example_of_the_stdlib_occurs_among_the_training_ids(stdlib_reference, examples):
    # Licence headers and boilerplate repeat across stdlib files: before de-duplication 4 held-out
    # windows and 29 held-out paragraphs (of 256) had exact copies among the training ids.
    data = build_dataset(DataConfig(name="stdlib", examples=examples, seq_len=64, max_len=256, heldout=256))
    assert_heldout_unseen_in_training(data, heldout=256)
    corpus, files = stdlib_reference
    reference = distinct_windows(corpus, 64) if examples == "windows" else distinct_paragraphs(files, 257)
    assert data.n_total == len(reference)  # only duplicates were dropped
    assert f"{data.duplicates:,} duplicates dropped" in data.description


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


def planted_text(folder: Path, T: int) -> list[bytes]:
    """Two files of random text with window-aligned repeats: within a file, across files, and a run."""
    rng = np.random.default_rng(5)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz \n", dtype=np.uint8)
    a = bytearray(letters[rng.integers(0, len(letters), 40 * T + 1)].tobytes())
    b = bytearray(letters[rng.integers(0, len(letters), 30 * T)].tobytes())
    block = bytes(a[3 * T : 4 * T + 1])  # window 3 of a.txt
    for w in (10, 20, 30):  # the same window later in a.txt
        a[w * T : w * T + T + 1] = block
    b[5 * T - 1 : 6 * T] = block  # and in b.txt (a.txt's 40*T + 1 bytes shift b.txt's grid by 1)
    a[33 * T : 37 * T + 1] = b"z" * (4 * T + 1)  # four equal windows in a row
    (folder / "a.txt").write_bytes(bytes(a))
    (folder / "b.txt").write_bytes(bytes(b))
    return [bytes(a), bytes(b)]


def test_text_files_windows_keep_the_first_of_each_content_before_shuffling(tmp_path):
    T = 16
    files = planted_text(tmp_path, T)
    corpus = b"".join(files)
    distinct = distinct_windows(corpus, T)
    windows = (len(corpus) - 1) // T
    assert windows - len(distinct) == 4 + 3  # the planted copies (a run of 4 equal windows keeps 1)
    cfg = DataConfig(name="text_files", path=str(tmp_path / "*.txt"), seq_len=T, heldout=12, shuffle_seed=3)
    data = build_dataset(cfg)
    assert data.n_total == len(distinct) and data.duplicates == windows - len(distinct)
    assert f"{len(distinct):,} windows of {T + 1} ({windows - len(distinct)} duplicates dropped)" in (
        data.description
    )
    # Stream id i is the i-th example of the shuffled order of the distinct windows (first occurrences).
    order = np.random.default_rng(3).permutation(len(distinct))
    assert contents(data, range(data.n_total)) == [distinct[k] for k in order]
    first = {}  # where each content first occurs as a window
    for w in range(windows):
        first.setdefault(corpus[w * T : w * T + T + 1], w * T)
    assert sorted(data._starts.tolist()) == sorted(first.values())
    assert_heldout_unseen_in_training(data, cfg.heldout)


def test_text_files_documents_keep_the_first_of_each_paragraph_as_cut(tmp_path):
    cut = 9  # max_len 8
    a = [b"licence header", b"unique one", b"abcdefghij-tail-1", b"x", b"", b"licence header", b"same"]
    b = [b"same", b"licence header", b"abcdefghij-tail-2", b"unique two", b"same\n"]
    files = [b"\n\n".join(a), b"\n\n".join(b)]
    (tmp_path / "a.txt").write_bytes(files[0])
    (tmp_path / "b.txt").write_bytes(files[1])
    distinct = distinct_paragraphs(files, cut)
    # Dropped: "licence header" (cut to "licence h") twice more, "same" once more, "abcdefghij-tail-2"
    # (equal to "abcdefghij-tail-1" once cut); "same\n" differs from "same"; "x" and "" are too short.
    assert distinct == [b"licence h", b"unique on", b"abcdefghi", b"same", b"unique tw", b"same\n"]
    cfg = DataConfig(
        name="text_files", path=str(tmp_path / "*.txt"), examples="documents", max_len=8, heldout=2
    )
    data = build_dataset(cfg)
    assert data.n_total == len(distinct) == 6 and data.duplicates == 4
    assert "4 duplicates dropped" in data.description
    order = np.random.default_rng(0).permutation(len(distinct))
    assert contents(data, range(data.n_total)) == [distinct[k] for k in order]
    assert_heldout_unseen_in_training(data, cfg.heldout)


def test_windows_are_settled_by_content_when_their_hashes_collide(tmp_path, monkeypatch):
    # The hash only groups candidates; equality is decided token for token. With every key equal
    # (or keys shared by different windows), the result is the same as with the real hash.
    T = 16
    planted_text(tmp_path, T)
    cfg = DataConfig(name="text_files", path=str(tmp_path / "*.txt"), seq_len=T, heldout=12)
    honest = build_dataset(cfg)
    for fake in (lambda keys: keys * 0, lambda keys: keys % np.uint64(3)):
        real = data_module._window_hashes
        monkeypatch.setattr(
            data_module, "_window_hashes", lambda *args, real=real, fake=fake: fake(real(*args))
        )
        colliding = build_dataset(cfg)
        monkeypatch.undo()
        assert colliding.n_total == honest.n_total and colliding.fingerprint == honest.fingerprint
        np.testing.assert_array_equal(
            colliding.get_many(range(honest.n_total)), honest.get_many(range(honest.n_total))
        )


def write_tokens(path: Path, tokens: np.ndarray) -> None:
    stored = np.memmap(path, dtype=tokens.dtype, mode="w+", shape=tokens.shape)
    stored[:] = tokens
    stored.flush()
    del stored


def test_token_bin_training_windows_never_repeat_a_heldout_window(tmp_path):
    T, heldout = 20, 20
    tokens = np.random.default_rng(2).integers(0, 50000, 100 * T + 1).astype(np.uint16)
    path = tmp_path / "train.bin"
    write_tokens(path, tokens)
    cfg = DataConfig(name="token_bin", path=str(path), seq_len=T, heldout=heldout)
    clean = build_dataset(cfg)
    assert clean.n_total == 100
    # Plant copies of one held-out window over 30 other windows (every other one: windows share a token).
    target = clean.get(clean.n_total - 1).astype(np.uint16)
    first = int(clean._starts[clean.n_total - 1]) // T
    copies = [w for w in range(0, 100, 2) if w != first and w != first - 1 and w != first + 1][:30]
    for w in copies:
        tokens[w * T : w * T + T + 1] = target
    write_tokens(path, tokens)
    data = build_dataset(cfg)
    assert_heldout_unseen_in_training(data, heldout)
    assert clean.duplicates == 0 and "(0 duplicates dropped)" in clean.description
    windows = [tokens[w * T : w * T + T + 1].tobytes() for w in range(100)]
    assert data.n_total == len(set(windows)) == 100 - 30 and data.duplicates == 30
    assert "70 windows of 21 (30 duplicates dropped)" in data.description
    kept = sorted(data._starts.tolist())
    assert kept == sorted(windows.index(window) * T for window in set(windows))  # first occurrences


def test_the_fingerprint_covers_the_shuffled_order(tmp_path, monkeypatch):
    # numpy does not promise default_rng(seed).permutation's stream across versions. A machine whose
    # numpy shuffles differently, with the same seed, source and settings, must get another fingerprint.
    write_random_text(tmp_path, {"x.txt": 3000})
    cfg = DataConfig(name="text_files", path=str(tmp_path / "x.txt"), seq_len=16, heldout=8, shuffle_seed=4)
    here = build_dataset(cfg)
    real_rng = np.random.default_rng

    class OtherNumpy:
        def __init__(self, seed):
            self.rng = real_rng(seed)

        def permutation(self, n):
            return self.rng.permutation(n)[::-1].copy()

    monkeypatch.setattr(np.random, "default_rng", OtherNumpy)
    elsewhere = build_dataset(cfg)
    monkeypatch.undo()
    np.testing.assert_array_equal(elsewhere.get_many([0]), here.get_many([here.n_total - 1]))
    assert elsewhere.fingerprint != here.fingerprint
    assert build_dataset(cfg).fingerprint == here.fingerprint


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
    with pytest.raises(UserError, match="matches no files") as error:
        build_dataset(DataConfig(name="text_files", path=glob))
    assert glob in str(error.value) and "\n" not in str(error.value)


def test_missing_or_ragged_token_file_is_a_one_line_config_error(tmp_path):
    missing = str(tmp_path / "absent.bin")
    with pytest.raises(UserError, match="is not a file") as error:
        build_dataset(DataConfig(name="token_bin", path=missing))
    assert missing in str(error.value) and "\n" not in str(error.value)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(UserError, match="3 bytes"):
        build_dataset(DataConfig(name="token_bin", path=str(odd)))
    documents = DataConfig(name="token_bin", path=str(odd), examples="documents")
    with pytest.raises(UserError, match="documents"):  # the source's own check, before any build
        data_source(documents).check(documents)


def test_stream_not_longer_than_heldout_is_a_config_error(tmp_path):
    write_random_text(tmp_path, {"tiny.txt": 641})  # (641 - 1) // 64 = 10 windows, all distinct
    path = str(tmp_path / "tiny.txt")
    cfg = DataConfig(name="text_files", path=path, seq_len=64, heldout=10)
    with pytest.raises(UserError, match="data.heldout=10") as error:
        build_dataset(cfg)
    message = str(error.value)
    assert (
        f"data.path={path!r} holds 641 bytes: 10 distinct windows, not more than data.heldout=10" in message
    )
    assert "valid: data.heldout < 10, or a source with more than data.heldout=10 windows" in message
    assert "\n" not in message
    cfg.heldout = 9
    assert build_dataset(cfg).n_total == 10
    (tmp_path / "same.txt").write_bytes(b"x" * 641)  # 10 windows, all equal: 1 distinct
    with pytest.raises(UserError, match="1 distinct window \\(9 duplicates dropped\\)") as error:
        build_dataset(DataConfig(name="text_files", path=str(tmp_path / "same.txt"), seq_len=64, heldout=1))
    assert "heldout < 1" not in str(error.value)


@pytest.mark.parametrize(
    "name,examples,unit",
    [
        ("text_files", "windows", "bytes"),
        ("text_files", "documents", "bytes"),
        ("token_bin", "windows", "tokens"),
    ],
)
def test_an_empty_source_is_a_one_line_error_naming_it(tmp_path, name, examples, unit):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    with pytest.raises(UserError) as error:
        build_dataset(DataConfig(name=name, path=str(path), examples=examples))
    message = str(error.value)
    one = examples.removesuffix("s").replace("document", "paragraph")
    assert message.startswith(f"data.path={str(path)!r} holds 0 {unit}: no {one}s (one needs ")
    assert message.endswith(f"; valid: a source with more than data.heldout=256 {one}s")
    assert "\n" not in message and "< 0" not in message


@pytest.mark.parametrize("examples", ["windows", "documents"])
def test_building_the_stdlib_dataset_is_fast(examples):
    start = time.perf_counter()
    build_dataset(DataConfig(name="stdlib", examples=examples))
    # ~0.15 s (windows) and ~0.2 s (documents) measured, de-duplication included; generous for slow CI.
    assert time.perf_counter() - start < 5.0


def test_every_data_choice_has_one_table_entry_and_every_entry_a_choice():
    """conf/data/*.yaml (what `data=` offers) and the table `hypertrain.data.SOURCES` name the same
    sources, and each preset selects the source it is named for."""
    import yaml

    from hypertrain.data import SOURCES

    presets = {}
    for path in sorted((REPO / "conf" / "data").glob("*.yaml")):
        tree = yaml.safe_load(path.read_text())
        presets[path.stem] = tree.get("data", tree)["name"]  # a global preset nests its data section
    assert presets == {name: name for name in presets}
    assert sorted(presets) == sorted(SOURCES)
    assert all(source.name == name for name, source in SOURCES.items())


@pytest.mark.parametrize("examples", ["windows", "documents"])
def test_a_text_source_entry_declares_what_its_built_dataset_is(tmp_path, examples):
    """What the memory estimate, the engines and `sample` ask of a byte-level text source before it is
    built is what the build gives: vocabulary 256, one channel, fixed windows or variable documents, the
    longest example the config allows (each paragraph here is longer than data.max_len + 1 = 21 bytes,
    and the text longer than a window), and ids that are the text's UTF-8 bytes."""
    text = "".join(f"paragraph {i}, longer than twenty bytes\n\n" for i in range(40)).encode()
    (tmp_path / "a.txt").write_bytes(text)
    cfg = DataConfig(
        name="text_files", path=str(tmp_path / "*.txt"), examples=examples, seq_len=16, max_len=20, heldout=4
    )
    source, data = data_source(cfg), build_dataset(cfg)
    assert source.vocab(cfg) == data.vocab == 256
    assert (
        not source.multistream
        and not isinstance(data, MultistreamDataset)
        and source.channel_vocabs(cfg) == []
    )
    assert source.variable_length(cfg) == (not data.fixed_length) == (examples == "documents")
    assert source.longest(cfg) == data.max_length == (17 if examples == "windows" else 21)
    assert source.tokenizer == "bytes" and bytes(data.get(0).astype(np.uint8)) in text
