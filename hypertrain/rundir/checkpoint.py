"""Checkpoints: the run's whole state at a sync or mid-round, written atomically, found and checked
on resume.

`Checkpointer` writes `run_dir/checkpoints/ckpt-u<next update>.pt` and beside it the sha256 of its
bytes (`ckpt-u<next update>.pt.sha256`, in place before the checkpoint is); a sharded run writes the
folder `ckpt-u<next update>.dcp` instead, one shard file per rank (`checkpoint_folder`, with the digest
of each file beside it). `load` checks the digests (torch's
zip reader checks no CRC: a flipped byte loads silently), `find` gives the newest that loads and
matches, `compatible` and `records_match` refuse (one line) a resume that does not belong to the run,
and `rewind_metrics` cuts metrics.jsonl back to it. docs/resume.md has the contents and every rule.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

from hypertrain.config import MAY_CHANGE, UserError, changed_fields, flatten, setting
from hypertrain.failures import fault_points
from hypertrain.records import formats
from hypertrain.records.rows import CheckpointRow, ResumeRow, StartRow, parse
from hypertrain.rundir import checkpoint_folder
from hypertrain.rundir.checkpoint_folder import digest_path, file_sha256
from hypertrain.rundir.records import METRICS_FILE

FORMAT = 1
FOLDER = "checkpoints"
SUPERSEDED_FILE = "metrics.superseded.jsonl"
_NAME = re.compile(r"ckpt-u(\d+)\.(pt|dcp)$")

# what a sharded run may change on resume beside MAY_CHANGE: its world (hence L = world.size / replicas,
# and the process count and layout derived from it); a single file's whole tensors are cut to any L, a
# sharded run's DCP folder is read resharded to any L
RESHARDED = ("world.size", "processes.nproc", "processes.layout")

PLAN_KEYS = ("data/fingerprint", "plan/union_sha256", "plan/data_order_sha256")


def path_for(run_dir: Path, next_update: int, sharded: bool = False) -> Path:
    """The checkpoint of `next_update`: a file, or (`sharded`: a sharded run's) a folder."""
    return Path(run_dir) / FOLDER / f"ckpt-u{next_update:07d}.{'dcp' if sharded else 'pt'}"


def is_checkpoint(path: Path) -> bool:
    """Whether `path` is one checkpoint: a file, or a sharded run's folder named as one."""
    path = Path(path)
    return path.is_file() or (path.is_dir() and _NAME.search(path.name) is not None)


def seal(path: Path, bytes_of: Path | None = None) -> None:
    """Write the sha256 of `bytes_of` (default `path`) as `path`'s digest, atomically and fsynced. The
    checkpointer seals its temporary file under the final name before renaming it into place; a test
    that edits a checkpoint on purpose (a whole, wrong state) seals the edited file."""
    digest = digest_path(path)
    tmp = digest.with_name(digest.name + ".tmp")
    try:
        with open(tmp, "w") as file:
            file.write(file_sha256(bytes_of or path) + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, digest)
    finally:
        tmp.unlink(missing_ok=True)


def write(path: Path, payload: dict, keep: int, ours: list[str] | None = None) -> tuple[int, float]:
    """Save `payload` atomically at `path`, keep the newest `keep` checkpoints; (bytes, seconds).
    With `ours` (the names of the checkpoints this run wrote, `path`'s added) only those are pruned."""
    import torch

    start = time.perf_counter()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as file:
            torch.save(payload, file)
            file.flush()
            os.fsync(file.fileno())
        seal(path, tmp)  # the digest first: a checkpoint in place always has its own
        fault_points.act(
            0, "checkpoint", range(payload["state"]["next_update"] - 1, payload["state"]["next_update"])
        )
        os.replace(tmp, path)
    except RuntimeError as e:  # torch.save reports a failed write (a full disk) as a RuntimeError
        if isinstance(e.__context__, OSError):
            raise OSError(e.__context__.errno, e.__context__.strerror, str(path)) from e
        raise
    finally:
        tmp.unlink(missing_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    prune(path, keep, ours)
    return path.stat().st_size, time.perf_counter() - start


def prune(path: Path, keep: int, ours: list[str] | None) -> None:
    """Keep the newest `keep` checkpoints beside `path` (just written); with `ours` only those named."""
    if ours is not None and path.name not in ours:
        ours.append(path.name)
    for old in checkpoints(path.parent.parent)[:-keep]:
        if ours is None or old.name in ours:
            checkpoint_folder.remove(old)
            digest_path(old).unlink(missing_ok=True)


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints, oldest first; UserError when RUN/checkpoints is there but no folder
    (a resume would train a round, then fail to write its first checkpoint)."""
    folder = Path(run_dir) / FOLDER
    if folder.exists() and not folder.is_dir():
        raise UserError(
            f"{folder} is not a folder, so the run cannot keep its checkpoints there; valid: that file "
            "moved away (a run's checkpoints/ is a folder it makes)"
        )
    found = [p for p in folder.glob("ckpt-u*") if _NAME.search(p.name)] if folder.is_dir() else []
    return sorted(found, key=lambda p: int(_NAME.search(p.name).group(1)))


def load(path: Path, weights_only: bool = False) -> dict:
    """A checkpoint's payload; UserError naming it when its bytes differ from the digest written with
    it, or it is truncated or not a checkpoint. A checkpoint from before digests (no `.sha256` beside
    it, and none promised in its payload) loads unchecked. The payload is in today's form
    (`records.formats.upgrade_checkpoint`); one of a newer schema is refused (`formats.NewerSchema`).
    `weights_only`: torch's safe unpickler (tensors, containers and numbers only: a reader such as
    `python -m hypertrain.sample` runs no code a file names)."""
    digest = digest_path(path)
    if path.is_dir():  # a sharded run's: its tensors stay in the folder (`shards_at`), read as shards
        checkpoint_folder.verify(path)
        saved = _payload(path, path / checkpoint_folder.STATE_FILE, weights_only)
        saved["state"]["shards_at"] = str(path)
        return saved
    if digest.is_file():
        want, got = digest.read_text().strip(), file_sha256(path)
        if got != want:
            raise UserError(
                f"checkpoint {path} is not the one that was written (its sha256 {got[:16]}... differs "
                f"from {digest.name}'s {want[:16]}...); valid: a checkpoint whose bytes match its digest"
            )
    saved = _payload(path, path, weights_only)
    if saved["sealed"] and not digest.is_file():
        raise UserError(
            f"checkpoint {path} was written with a digest, and {digest.name} is missing; valid: a "
            "checkpoint beside its digest"
        )
    return saved


def _payload(path: Path, file: Path, weights_only: bool) -> dict:
    """Checkpoint `path`'s payload read from `file` (itself, or a folder's run.pt), in today's form."""
    import torch  # only to read one: a refusal made from the config alone never imports it

    try:
        saved = torch.load(file, map_location="cpu", weights_only=weights_only)
    except Exception as e:  # truncated zip, not a torch file, unreadable: all mean "not usable"
        raise UserError(
            f"checkpoint {path} cannot be read ({type(e).__name__}); valid: a whole checkpoint"
        ) from None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise UserError(f"{path} is not a hypertrain checkpoint (format {FORMAT}); valid: a whole checkpoint")
    return formats.upgrade_checkpoint(saved, f"checkpoint {path}")


def find(path: Path) -> tuple[Path, dict] | None:
    """The checkpoint `path` names (a file), or the newest usable one of the run directory `path`;
    None when the directory has none. A corrupt newest one falls back to the one before, warning."""
    path = Path(path)
    if is_checkpoint(path):
        return path, load(path)
    found = checkpoints(path)
    unreadable: UserError | None = None  # the newest one that did not load
    for candidate in reversed(found):
        try:
            saved = load(candidate)
        except formats.NewerSchema:  # not corrupt: resuming from an older one would go back silently
            raise
        except UserError as e:
            unreadable = unreadable or e
            continue
        if unreadable is not None:  # before Hydra's job logging exists: straight to stderr
            print(f"hypertrain: warning: {unreadable}; resuming from {candidate} instead", file=sys.stderr)
        return candidate, saved
    if found:
        raise UserError(f"no checkpoint in {path / FOLDER} can be read; valid: a run with a whole checkpoint")
    return None


def compatible(saved: dict, resolved: dict, plan_facts: dict) -> None:
    """Raise UserError (one line) unless the run `resolved` may continue the saved one (`load`'s
    payload: its config in today's shape)."""
    before, now = flatten(saved["config"]), flatten(resolved)
    changed = changed_fields(before, now)
    if now.get("processes.shard"):  # sharded replicas reshard: another L (world.size) with the same R
        changed = [k for k in changed if k not in RESHARDED]
    # A longer phase changes the default decay (it ends at the phase's last update) along with it.
    longer = now.get("phase.updates", 0) > before.get("phase.updates", 0)
    extended = longer and set(changed) <= {"phase.updates", "inner.decay_steps"}
    if extended and now["inner.decay_steps"] != before["inner.decay_steps"]:
        raise UserError(
            f"phase.updates={now['phase.updates']} extends the run ({before['phase.updates']} before) but "
            "the learning-rate schedule of the updates already run would change; valid: the same "
            f"inner.decay_steps as before, set explicitly (inner.decay_steps={before['inner.decay_steps']})"
        )
    if changed and not extended:
        # what the user changed, not a field derived from it (its advice would loop), nor a longer phase
        key = next(k for k in changed if not (longer and k == "phase.updates"))
        there = setting(key, before.get(key))
        if key == "phase.updates":  # shorter: it may change, but only to a longer phase
            raise UserError(
                f"phase.updates={now[key]} shortens the run ({before[key]} before); a resumed run may change "
                f"phase.updates only to a longer phase; valid: resume with {there} or more, or start a new "
                "run in another directory"
            )
        raise UserError(
            f"{setting(key, now.get(key))} differs from the checkpoint's {there}; a resumed run may change "
            f"only {', '.join(f'{k}.*' for k in MAY_CHANGE[:3])} and phase.updates; valid: resume with "
            f"{there}, or start a new run in another directory"
        )
    # With only phase.updates longer, the ids of the updates already run are the same by the plan's
    # definition, given the same data in the same order (the fingerprint covers both).
    keys = PLAN_KEYS[:1] if extended else PLAN_KEYS
    differ = [k for k in keys if saved["plan"][k] != plan_facts[k]]
    if differ:
        raise UserError(
            f"{differ[0]}={plan_facts[differ[0]][:16]}... differs from the checkpoint's "
            f"{saved['plan'][differ[0]][:16]}...: the data or its order changed; valid: the run's own data"
        )


def _on_cpu(tree):
    """`tree` (dicts and lists of tensors, tensors, plain values) with every tensor copied to the CPU."""
    if isinstance(tree, dict):
        return {k: _on_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):  # e.g. an outer optimizer's state per fragment
        return [_on_cpu(v) for v in tree]
    return tree.detach().cpu() if hasattr(tree, "detach") else tree


class Checkpointer:
    """Writes the run's checkpoints: every process calls `after_sync` at a sync, `after_update` after
    the updates of a round's part and `save` for a stop (the replicas' states are gathered to rank 0);
    rank 0 writes and logs a `checkpoint` row (size, seconds). `every` counts syncs, `every_updates`
    the updates from the phase's start (mid-round only; a round's end is the sync's)."""

    def __init__(
        self,
        run_dir: Path,
        resolved: dict,
        plan_facts: dict,
        every: int,
        keep: int,
        log,
        groups,
        every_updates: int = 0,
        ours: list[str] | None = None,
    ):
        self.run_dir, self.resolved, self.every, self.keep = Path(run_dir), resolved, every, keep
        self.ours = list(ours or [])  # names of the checkpoints this run wrote: the only ones pruned
        self.every_updates = every_updates
        self.plan = {k: plan_facts[k] for k in PLAN_KEYS}
        self.log, self.groups = log, groups
        self.saved_at: int | None = None  # the next update of the newest checkpoint this session wrote

    def after_sync(self, state, last: bool) -> None:
        if self.every and (last or state.rounds_done % self.every == 0):
            self.save(state)

    def after_update(self, state) -> None:
        """Mid-round: a checkpoint when `next_update` is a multiple of `every_updates`."""
        if self.every_updates and state.mid_round and state.next_update % self.every_updates == 0:
            self.save(state)

    def save(self, state) -> Path | None:
        """Write a checkpoint of `state` now (every process calls it); its path on the writer. A sharded
        run's tensors are written by every rank as its shards (DCP), the rest by the writer; otherwise
        the writer gathers the replicas' states and writes one file."""
        mid, sharded = state.mid_round, self.groups.checkpoints_by_shard
        every = self.groups.gather_replicas([_on_cpu(r) for r in state.replica_records()])
        path = path_for(self.run_dir, state.next_update, sharded)
        if sharded:
            start = time.perf_counter()
            if self.groups.is_writer:
                checkpoint_folder.prepare(path)
            self.groups.max_over_processes(0)  # the folder is there before any rank writes into it
            self.groups.checkpoint_shards(checkpoint_folder.temporary(path), state)
        else:  # the whole global weights and outer momentum
            weights, momentum = self.groups.whole(state.theta), self.groups.whole(state.outer.momentum)
        self.saved_at = state.next_update
        if not self.groups.is_writer:
            return None
        saved = state.state_dict(every)
        if sharded:
            saved = self.groups.without_shards(saved)
        else:
            saved["theta"], saved["outer_momentum"] = weights, momentum
        saved["comm_measured"] = self.groups.measured_since_sync()  # the writer's, as its rows
        payload = self._payload(saved)
        if sharded:
            size = checkpoint_folder.finish(path, lambda file: _save_synced(payload, file), _fault(payload))
            prune(path, self.keep, self.ours)
            seconds = time.perf_counter() - start
        else:
            size, seconds = write(path, payload, self.keep, self.ours)
        self.log.write(
            CheckpointRow(
                update=state.next_update,
                round=state.rounds_done,
                mid_round=mid,
                path=str(path),
                bytes=size,
                seconds=seconds,
            )
        )
        return path

    def _payload(self, saved: dict) -> dict:
        return {
            "format": FORMAT,
            formats.VERSION_KEY: formats.SCHEMA_VERSION,
            "sealed": True,  # its digest is written beside it: one missing is refused (`load`)
            "state": saved,
            "config": self.resolved,
            "plan": self.plan,
            "metrics_bytes": self.log.position(),
            "metrics_sha256": self.log.digest(),
            "run_id": self.log.run_id,
            "wandb_run_id": self.log.wandb_run_id,
        }


def _save_synced(payload: dict, file: Path) -> None:
    import torch

    with open(file, "wb") as out:
        torch.save(payload, out)
        out.flush()
        os.fsync(out.fileno())


def _fault(payload: dict):
    """Tests only: the fault point between a checkpoint's digest and its rename (`write`'s)."""
    update = payload["state"]["next_update"]
    return lambda: fault_points.act(0, "checkpoint", range(update - 1, update))


def drop_later(run_dir: Path, next_update: int) -> list[Path]:
    """Remove the run's checkpoints past `next_update`: resuming from an earlier one abandons them
    (their records are superseded), and they must never be found as the newest again; and the
    temporary file or folder of a write that a kill cut short (a whole one is renamed into place)."""
    later = [p for p in checkpoints(run_dir) if int(_NAME.search(p.name).group(1)) > next_update]
    folder = Path(run_dir) / FOLDER
    cut_short = sorted(folder.glob("ckpt-u*.tmp")) if folder.is_dir() else []  # a file or a folder
    for path in later + cut_short:
        checkpoint_folder.remove(path)
        digest_path(path).unlink(missing_ok=True)
    kept = {p.name for p in checkpoints(run_dir)}
    for digest in sorted(folder.glob("ckpt-u*.sha256")) if folder.is_dir() else []:
        if digest.name.removesuffix(".sha256") not in kept:  # a kill between the digest and its checkpoint
            digest.unlink()
    return later


def rewind_metrics(run_dir: Path, length: int) -> int:
    """Cut metrics.jsonl back to `length` bytes, appending what was cut to metrics.superseded.jsonl
    (never lost); returns the bytes moved. A file shorter than `length` is never extended (the
    preflight's `records_match` refuses such a resume before anything is changed)."""
    metrics = Path(run_dir) / METRICS_FILE
    data = metrics.read_bytes() if metrics.exists() else b""
    if len(data) < length:
        raise ValueError(f"{metrics} holds {len(data)} bytes, fewer than {length}: nothing to rewind")
    if not metrics.exists():
        return 0
    tail = data[length:]
    if tail:
        with open(Path(run_dir) / SUPERSEDED_FILE, "ab") as superseded:
            superseded.write(tail)
            superseded.flush()
            os.fsync(superseded.fileno())
    with open(metrics, "r+b") as file:
        file.truncate(length)
    return len(tail)


def written_by_run(run_dir: Path, resumed: Path | None = None) -> list[str]:
    """Names of the checkpoints the run in `run_dir` wrote, as its metrics.jsonl's `checkpoint` rows
    name them (after a rewind: the sessions up to the checkpoint resumed from), and as its `resume`
    rows and `resumed` name them: what pruning may remove, and nothing else. A checkpoint's own row
    lies past the length it recorded, so resuming from it moves that row aside; the resume row (of a
    checkpoint `records_match` found to be this run's) stands for it, or a checkpoint an earlier
    session resumed from would never be pruned."""
    names: list[str] = []
    metrics = Path(run_dir) / METRICS_FILE
    if metrics.exists():
        with open(metrics, encoding="utf-8", errors="replace") as rows:
            for line in rows:
                if '"checkpoint"' not in line and '"resume"' not in line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                path = _written_path(row)
                if path:
                    names.append(Path(path).name)
    if resumed is not None:
        names.append(Path(resumed).name)
    return sorted(set(names))


def _written_path(row) -> str | None:
    """The checkpoint a `checkpoint` row (its `path`) or a `resume` row (its `from`) names."""
    row = parse(row)
    path = row.path if isinstance(row, CheckpointRow) else row.from_ if isinstance(row, ResumeRow) else None
    return str(path) if path else None


def _start_rows(data: bytes) -> list[StartRow]:
    """The `start` rows among `data`'s lines (unreadable lines skipped)."""
    starts = []
    for line in data.splitlines():
        if b'"start"' not in line:
            continue
        try:
            row = parse(json.loads(line))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(row, StartRow):
            starts.append(row)
    return starts


def _another_run(path: Path, run_id: str, metrics: Path, theirs: str | None) -> UserError:
    return UserError(
        f"checkpoint {path} is of run {run_id} but {metrics} is of run {theirs}; valid: a checkpoint of the "
        "run whose records are in this directory"
    )


def records_match(run_dir: Path, path: Path, saved: dict) -> None:
    """Raise UserError (one line) unless `run_dir`'s metrics.jsonl holds the records checkpoint
    `path` (payload `saved`) was written with: at least its recorded length, the session that wrote
    it (the last `start` row before that length) of the same run id, and the same sha256 of the
    bytes up to that length. A checkpoint whose run id no session of the records has is named as
    another run's, whatever its length. A checkpoint written before run ids and digests were saved is
    checked by the length alone (and that the length ends a row)."""
    metrics = Path(run_dir) / METRICS_FILE
    length = int(saved["metrics_bytes"])
    if not metrics.is_file():
        raise UserError(
            f"{metrics} is missing but checkpoint {path} goes on from its first {length} bytes; valid: "
            "the run's own metrics.jsonl beside its checkpoints (restore it), or a new run directory"
        )
    data = metrics.read_bytes()
    run_id, digest = saved["run_id"], saved["metrics_sha256"]
    # Another run's checkpoint (its id in no session of these records) is named as such first: its
    # length, longer than these records, says nothing of rows lost here.
    ids = [row.run_id for row in _start_rows(data)]
    if run_id is not None and ids and run_id not in ids:
        raise _another_run(path, run_id, metrics, ids[-1])
    if len(data) < length:
        raise UserError(
            f"{metrics} holds {len(data)} bytes, fewer than the {length} checkpoint {path} was written "
            "after: rows were lost; valid: the run's own metrics.jsonl (restore it), or a new run directory"
        )
    kept = data[:length]
    if run_id is not None:
        starts = _start_rows(kept)
        theirs = starts[-1].run_id if starts else None
        if theirs != run_id:
            raise _another_run(path, run_id, metrics, theirs)
    if digest is not None:
        got = hashlib.sha256(kept).hexdigest()
        if got != digest:
            raise UserError(
                f"{metrics} up to byte {length} has sha256 {got[:12]}..., not the {digest[:12]}... "
                f"checkpoint {path} recorded: its rows were changed; valid: the run's own unedited "
                "metrics.jsonl, or a new run directory"
            )
    elif length and not kept.endswith(b"\n"):
        raise UserError(
            f"{metrics} does not end a row at byte {length}, where checkpoint {path} (no digest: written "
            "before records were checked) goes on; valid: the run's own metrics.jsonl"
        )
