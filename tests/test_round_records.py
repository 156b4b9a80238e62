"""A round's records are read by column name: each replica's (`REPLICA_COLUMNS`) and each process's
(`PROCESS_COLUMNS`) column holds what its name says, and an unknown or missing name is refused."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from helpers import small_cfg

from hypertrain.diloco.rounds import rounds
from hypertrain.diloco.state import RunState
from hypertrain.engines.columns import PROCESS_COLUMNS, REPLICA_COLUMNS, Columns
from hypertrain.preflight.prepare import initial_weights, prepare


def test_each_named_column_of_a_rounds_records_holds_what_its_name_says():
    cfg = small_cfg(replicas=4)
    tail = replace(cfg.phase, offset=prepare(cfg).samples - 24 - 2, updates=2)  # update 2: 2 ids, 4 replicas
    run = prepare(replace(cfg, phase=tail, inner=replace(cfg.inner, H=2)))
    (rnd,) = rounds(run, RunState.start(run.cfg, initial_weights(run)))
    assert rnd.table.shape[-1] == len(REPLICA_COLUMNS) and rnd.ranks.shape[-1] == len(PROCESS_COLUMNS)
    for t in range(2):
        batches = [a.batches[t] for a in rnd.assigns]
        losses = [res.losses[t] for res in rnd.results]
        assert rnd.losses(t) == losses
        assert [None if math.isnan(x) else x for x in rnd.replica_column("loss")[t].tolist()] == losses
        assert rnd.replica_column("targets")[t].tolist() == [b.replica_total for b in batches]
        assert rnd.replica_column("microbatches")[t].tolist() == [len(b.microbatches) for b in batches]
        assert rnd.replica_column("text_loss")[t].isnan().all()  # a text model has no channels
        assert rnd.process_column("samples")[0, t] == sum(b.samples for b in batches)
        assert rnd.process_column("tokens")[0, t] == sum(b.targets for b in batches)
        assert rnd.process_column("padded")[0, t] == sum(b.padded for b in batches)
        assert rnd.process_column("frames")[0, t] == sum(b.frames for b in batches)
        timings = {id(res.seconds): res.seconds[t] for res in rnd.results}  # stacked replicas share one
        assert rnd.process_column("seconds")[0, t] == sum(timings.values()) > 0
    assert rnd.losses(1)[2:] == [None, None]  # the skipped replicas: NaN in the loss column


def test_a_column_is_read_and_written_by_its_name_only():
    columns = Columns("loss", "targets")
    assert columns.row(targets=7, loss=0.5) == [0.5, 7]
    with pytest.raises(KeyError, match="'tokens' is not a column; valid: loss, targets"):
        columns.index("tokens")
    with pytest.raises(AssertionError, match="a row needs"):
        columns.row(loss=0.5)
