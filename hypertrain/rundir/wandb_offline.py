"""Read an offline W&B run back from its `.wandb` file, without W&B's servers or its sync tool.

`read_run(path)` returns the logged history rows, the summary, the config and the exit code, decoded
with wandb's own protobuf `Record` from the file's framing (described beside its constants below).
"""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path
from typing import Any

# The framing is the LevelDB log format as wandb-core writes it (`core/pkg/leveldb`, the IEEE CRC): a
# 7-byte file header (`:W&B`, magic 0xBEE1 little-endian, a version byte), then 32 KiB blocks of
# chunks, each a 7-byte header (CRC-32 of the type byte and payload, uint32 LE; payload length, uint16
# LE; the type, FULL 1, FIRST 2, MIDDLE 3, LAST 4) and its payload; a block tail shorter than a header
# is zero padding.
BLOCK_SIZE = 32 * 1024
HEADER_SIZE = 7
FILE_IDENT = b":W&B"
FILE_MAGIC = 0xBEE1
KNOWN_VERSIONS = (0, 1)  # wandb 0.31 writes 0; later wandb-core writes 1 with the same framing
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


class WandbFileError(ValueError):
    """The file is not a readable `.wandb` transaction log."""


def run_file(path: Path | str) -> Path:
    """The `.wandb` file of `path`: the file itself, or the one `run-*.wandb` in a run folder."""
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.glob("run-*.wandb"))
    if len(found) != 1:
        raise WandbFileError(f"{path} holds {len(found)} run-*.wandb files; valid: exactly one")
    return found[0]


def iter_payloads(path: Path | str):
    """Yield each record's bytes in order; a record cut short at the end of the file is dropped."""
    data = Path(path).read_bytes()
    if len(data) < HEADER_SIZE:
        raise WandbFileError(f"{path}: {len(data)} bytes is too short for a .wandb header")
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER_SIZE])
    if ident != FILE_IDENT or magic != FILE_MAGIC:
        raise WandbFileError(f"{path}: not a .wandb file (header {data[:HEADER_SIZE]!r})")
    if version not in KNOWN_VERSIONS:
        raise WandbFileError(f"{path}: .wandb version {version} is unknown; valid: {KNOWN_VERSIONS}")
    yield from _chunks(data, HEADER_SIZE, path, from_record_start=True)


def _chunks(data: bytes, pos: int, path, *, from_record_start: bool):
    """Reassemble records from the chunks starting at `pos`; with `from_record_start` False, chunks
    that continue a record begun before `pos` are skipped instead of being an error."""
    pending = None
    while pos + HEADER_SIZE <= len(data):
        left_in_block = BLOCK_SIZE - pos % BLOCK_SIZE
        if left_in_block < HEADER_SIZE:
            pos += left_in_block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER_SIZE])
        if checksum == 0 and length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left_in_block
            continue
        start, end = pos + HEADER_SIZE, pos + HEADER_SIZE + length
        if length > left_in_block - HEADER_SIZE:
            raise WandbFileError(f"{path}: the chunk at byte {pos} overflows its block")
        if end > len(data):
            return  # the writer stopped mid-chunk (a killed run)
        payload = data[start:end]
        if zlib.crc32(bytes([kind]) + payload) != checksum:
            raise WandbFileError(f"{path}: checksum mismatch in the chunk at byte {pos}")
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = [payload]
        elif kind in (MIDDLE, LAST) and pending is not None:
            pending.append(payload)
            if kind == LAST:
                yield b"".join(pending)
                pending = None
        elif kind not in (MIDDLE, LAST) or from_record_start:
            raise WandbFileError(f"{path}: chunk type {kind} at byte {pos} is out of order")
        pos = end


def has_exit_record(path: Path | str) -> bool:
    """Whether the run's exit record is on disk, reading only the file's last blocks.

    wandb-core writes the transaction log in whole 32 KiB blocks and the last partial block when the
    run's stream closes, which `run.finish()` requests but does not wait for.
    """
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    start = max(0, (len(data) // BLOCK_SIZE - 2) * BLOCK_SIZE)
    for payload in _chunks(data, max(start, HEADER_SIZE), path, from_record_start=start == 0):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "exit":
            return True
    return False


def wait_for_exit_record(path: Path | str, timeout: float = 10.0) -> bool:
    """Poll until the `.wandb` file holds its exit record; False if `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while not has_exit_record(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.2)
    return True


def iter_records(path: Path | str):
    """Yield each `wandb.proto.wandb_internal_pb2.Record` of a `.wandb` file (or run folder)."""
    from wandb.proto import wandb_internal_pb2

    for payload in iter_payloads(run_file(path)):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def _item_key(item) -> list[str]:
    return list(item.nested_key) if item.nested_key else [item.key]


def _item_value(item) -> Any:
    which = item.WhichOneof("value") if "value" in type(item).DESCRIPTOR.oneofs_by_name else None
    if which == "none":
        return None
    if which == "json":
        return json.loads(item.json)
    if which is not None:
        return getattr(item, which)
    return json.loads(item.value_json)


def _set_nested(target: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


def _remove_nested(target: dict, keys: list[str]) -> None:
    for key in keys[:-1]:
        target = target.get(key, {})
    target.pop(keys[-1], None)


def _apply(target: dict, update_items, remove_items=()) -> None:
    for item in update_items:
        _set_nested(target, _item_key(item), _item_value(item))
    for item in remove_items:
        _remove_nested(target, _item_key(item))


def read_run(path: Path | str) -> dict:
    """The run in a `.wandb` file or an `offline-run-*` folder, as plain Python values.

    Keys: `history` (one dict per logged row, nested keys joined with "."; wandb adds `_step`,
    `_runtime`, `_timestamp`), `summary` and `config` (nested dicts, after every update in order;
    the config holds wandb's own `_wandb` entry), `exit_code` (None when the run never finished),
    `run` (`id`, `project`, `entity`, `name`, `group`, `job_type`, `tags`) and `metrics` (each
    `define_metric` as `{"name", "step_metric"}`).
    """
    history: list[dict] = []
    summary: dict = {}
    config: dict = {}
    metrics: list[dict] = []
    run: dict = {}
    exit_code = None
    for record in iter_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({".".join(_item_key(item)): _item_value(item) for item in record.history.item})
        elif kind == "summary":
            _apply(summary, record.summary.update, record.summary.remove)
        elif kind == "config":
            _apply(config, record.config.update, record.config.remove)
        elif kind == "run":
            r = record.run
            run = {
                "id": r.run_id,
                "project": r.project,
                "entity": r.entity,
                "name": r.display_name,
                "group": r.run_group,
                "job_type": r.job_type,
                "tags": list(r.tags),
            }
            _apply(config, r.config.update, r.config.remove)
            _apply(summary, r.summary.update, r.summary.remove)
        elif kind == "metric":
            m = record.metric
            metrics.append({"name": m.name or m.glob_name, "step_metric": m.step_metric})
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return {
        "history": history,
        "summary": summary,
        "config": config,
        "exit_code": exit_code,
        "run": run,
        "metrics": metrics,
    }
