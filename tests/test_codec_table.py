"""The codec table (hypertrain/codec_table.py) is the one place a codec is named: the config's valid
`outer.compress` values, the codecs module's block codecs and the docs' option lists are its entries,
an entry's declared wire format is the payload it sends, and no module outside the table's own
compares a codec's name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import compose_train
from omegaconf import OmegaConf

from hypertrain.codec_table import BLOCK_CODECS, ELEMENTWISE, ENTRIES, IMPORTED, TABLE
from hypertrain.codecs import kernels as codecs
from hypertrain.config import LowRankConfig, OuterConfig, UserError

REPO = Path(__file__).resolve().parents[1]


def test_the_valid_values_the_docs_and_the_table_agree():
    names = [entry.name for entry in ENTRIES]
    assert list(TABLE) == names and len(set(names)) == len(names)
    # what the config takes: its check's refusal of a value that is no entry names every valid one
    cfg = OmegaConf.to_object(compose_train(["outer.compress=bogus"]))
    with pytest.raises(UserError) as caught:
        cfg.outer.check()
    valid = str(caught.value).split("; valid: ", 1)[1]
    assert valid == ", ".join(names) + ", or " + IMPORTED
    assert codecs.CODECS == BLOCK_CODECS == tuple(entry.name for entry in ENTRIES if entry.blocks)
    # docs/compression.md's options table: the `outer.compress` row's values, in order
    page = (REPO / "docs" / "compression.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `outer.compress` |"))
    assert re.findall(r"`(\w+)`", row.split("|")[2]) == names
    # README's `outer` row: the block codecs as one list, every other entry but none on its own
    readme = next(
        line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| `outer`")
    )
    listed = re.findall(r"`outer\.compress=([\w\\|]+)[` ]", readme)
    assert listed[0].split("\\|") == list(BLOCK_CODECS)
    assert sorted(listed[1:]) == sorted(e.name for e in ENTRIES if not e.blocks and not e.lossless)


@pytest.mark.parametrize("name", [e.name for e in ENTRIES if e.scope == ELEMENTWISE])
def test_an_elementwise_entry_sends_what_its_wire_format_declares(name):
    # blocks of 32, 32, 5 | 7 (two tensors): per block its header, then ceil(L * bits / 8) bytes of codes
    entry, blocks = TABLE[name], codecs.Blocks((69, 7), 32)
    lengths = [32, 32, 5, 7]
    declared = sum(entry.header_bytes + -(-length * entry.value_bits // 8) for length in lengths)
    assert codecs.payload_size(name, blocks) == declared


# a codec's name compared with ==, !=, in or not in: `outer.compress == "none"`, `compress in (...)`,
# `shape.compress != "topk"`, `Compressor.topk ==`
COMPARED = re.compile(
    r"compress\W*\s*(==|!=|\bin\b|\bnot in\b)|(==|!=)\s*Compressor\.|Compressor\.\w+\s*(==|!=)"
)


def test_no_module_but_the_tables_own_compares_a_codec_name():
    own = {REPO / "hypertrain" / "codec_table.py", REPO / "hypertrain" / "diloco" / "codecs.py"}
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in sorted((REPO / "hypertrain").rglob("*.py"))
        if path not in own
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if COMPARED.search(line.split("#")[0])
    ]
    assert not found, found


def test_the_low_rank_node_exists_only_with_low_rank_a_field_of_it_set_with_another_codec_is_one_it_lacks():
    """outer.lowrank is low rank's node (its entry's `node`): None under another codec (its rank was read by
    low rank alone, and ignored by the others), at its defaults with lowrank; set with another codec, one
    line naming the field and the codec it lives under."""
    base = OuterConfig()
    assert base.lowrank is None and OuterConfig(compress="lowrank").lowrank == LowRankConfig()
    assert OuterConfig(compress="topk", lowrank=LowRankConfig()).lowrank is None
    with pytest.raises(UserError) as caught:
        OuterConfig(compress="topk", lowrank=LowRankConfig(rank=2)).check()
    assert str(caught.value) == (
        "outer.lowrank.rank is not a field of outer.compress=topk: outer.lowrank exists only with "
        "outer.compress=lowrank; valid: outer.compress=lowrank, or no outer.lowrank.*"
    )
    OuterConfig(compress="lowrank", lowrank=LowRankConfig(rank=2)).check()
    assert [entry.name for entry in ENTRIES if entry.node] == ["topk", "lowrank"]


def test_the_older_spelling_of_low_ranks_rank_with_another_codec_is_dropped_with_a_note(tmp_path):
    """outer.lowrank_rank=2 with outer.compress=int8 worked before low rank had its node (int8 ignored
    the rank): it still runs, the rank dropped (no outer.lowrank node in config.yaml), a note in
    train.log only; today's spelling there is refused (the test above). With lowrank it is read as
    outer.lowrank.rank."""
    from helpers import RUN, entry
    from omegaconf import OmegaConf

    for codec, node in (("int8", None), ("lowrank", {"rank": 2})):
        run_dir = tmp_path / codec
        args = [*RUN, "phase.updates=1", f"outer.compress={codec}", "outer.lowrank_rank=2"]
        done = entry([*args, f"hydra.run.dir={run_dir}"], tmp_path)
        assert done.returncode == 0, done.stderr
        assert "has no effect" not in done.stderr + done.stdout and "spelled" not in done.stderr + done.stdout
        written = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml").outer)
        assert written["lowrank"] == node
        dropped = "note: outer.lowrank_rank=2 has no effect with outer.compress=int8: dropped"
        assert (dropped in (run_dir / "train.log").read_text()) == (node is None)


def test_top_ks_older_spellings_read_as_its_node_and_dropped_with_a_note_under_another_codec(tmp_path):
    """outer.topk_fraction, outer.index_bits and outer.topk_values (before top-k had its node) still run:
    with top-k read as outer.topk.*, with int8 (which ignored the fraction) dropped, each with a note in
    train.log only; config.yaml holds the node, or none (null)."""
    from helpers import RUN, entry
    from omegaconf import OmegaConf

    older = ["outer.topk_fraction=0.5", "outer.index_bits=12", "outer.topk_values=fp16"]
    for codec, node in (("int8", None), ("topk", {"fraction": 0.5, "index_bits": 12, "values": "fp16"})):
        run_dir = tmp_path / codec
        done = entry(
            [*RUN, "phase.updates=1", f"outer.compress={codec}", *older, f"hydra.run.dir={run_dir}"], tmp_path
        )
        assert done.returncode == 0, done.stderr
        assert "has no effect" not in done.stderr + done.stdout and "spelled" not in done.stderr + done.stdout
        assert OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml").outer)["topk"] == node
        log = (run_dir / "train.log").read_text()
        assert "note: outer.index_bits= is now spelled outer.topk.index_bits= " in log
        dropped = "note: outer.topk_fraction=0.5 has no effect with outer.compress=int8: dropped"
        assert (dropped in log) == (node is None)


SHARED = {
    "block": 16,
    "tile": 4,
    "transform": "dct",
    "reduce": "two_phase",
    "error_decay": 0.5,
}  # none default


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_a_shared_codec_field_is_set_only_with_a_codec_whose_entry_takes_it(entry):
    """outer.codec's fields are read by the codecs whose entry says so (`Codec.takes`: a block codec the
    blocks' size, order, transform and reduction, a codec that feeds back the buffers' decay): set with one,
    it passes the check (two_phase: unless the entry says it gathers only, one line saying why); with
    another, one line naming the field, its value and the codecs that read it."""
    from hypertrain.config import CodecConfig

    assert (
        entry.takes
        == ("block", "tile", "transform", "reduce") * entry.blocks + ("error_decay",) * entry.error_feedback
    )
    for name, value in SHARED.items():
        square = {"block": 16} if name == "tile" and name in entry.takes else {}  # a tile is one block
        node = CodecConfig(**{name: value} | square)
        outer = OuterConfig(compress=entry.name, codec=node, error_feedback=entry.error_feedback)
        if name in entry.takes and name == "reduce" and entry.gather_only:
            with pytest.raises(UserError, match=f"two_phase: {entry.gather_only}; valid: outer.codec.reduce"):
                outer.check()
            continue
        if name in entry.takes:
            outer.check()
            continue
        with pytest.raises(UserError) as refused:
            outer.check()
        readers = ", ".join(e.name for e in ENTRIES if name in e.takes)
        assert str(refused.value).startswith(
            f"outer.codec.{name}={value} is not read by outer.compress={entry.name}; valid: a codec that "
            f"reads it ({readers}), or outer.codec.{name}="
        )


def test_the_shared_fields_older_spellings_read_as_outer_codec_and_an_unread_block_is_dropped(tmp_path):
    """outer.block, outer.tile, outer.transform, outer.reduce and outer.error_decay (before outer.codec)
    still run: read as outer.codec.* with a note in train.log only; outer.block and outer.reduce with
    compress=none (which ignored them) are dropped with a note; config.yaml holds the node."""
    from helpers import RUN, entry

    runs = {
        "int8": (
            ["outer.block=16", "outer.tile=4", "outer.transform=dct", "outer.error_feedback=true"],
            ["outer.error_decay=0.5", "outer.reduce=two_phase"],
            {"block": 16, "tile": 4, "transform": "dct", "reduce": "two_phase", "error_decay": 0.5},
        ),
        "none": (
            ["outer.block=64", "outer.reduce=two_phase"],
            [],
            {"block": 128, "tile": 0, "transform": "none", "reduce": "gather", "error_decay": 1.0},
        ),
    }
    for codec, (given, more, node) in runs.items():
        run_dir = tmp_path / codec
        args = [*RUN, "phase.updates=1", f"outer.compress={codec}", *given, *more, f"hydra.run.dir={run_dir}"]
        done = entry(args, tmp_path)
        assert done.returncode == 0, done.stderr
        assert "has no effect" not in done.stderr + done.stdout and "spelled" not in done.stderr + done.stdout
        assert OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml").outer)["codec"] == node
        log = (run_dir / "train.log").read_text()
        assert "note: outer.block= is now spelled outer.codec.block= " in log
        dropped = "note: outer.block=64 has no effect with outer.compress=none: dropped"
        assert (dropped in log) == (codec == "none")
        dropped = "note: outer.reduce=two_phase has no effect with outer.compress=none: dropped"
        assert (dropped in log) == (codec == "none")
