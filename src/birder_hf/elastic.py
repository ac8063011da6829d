"""Elastic restarts: which checkpoint is complete on every rank, which one a restart resumes from, and which job
writes an output folder.

A checkpoint is usable only if every rank's file was written (``birder_hf.checkpoint``: one file per rank), and the
framework's files with them: :func:`mark_checkpoint_complete` writes ``birder_complete.json`` last, recording every
file's size and SHA-256, and :func:`find_resumable_checkpoint` (what ``--resume_from_checkpoint auto`` runs after an
elastic restart) takes the newest checkpoint it marks complete, unchanged since (:func:`checkpoint_problem`).
:func:`claim_output_dir` stops a second job from writing the same folder (``_birder.lock``, ``fcntl.flock``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import tempfile
import time

from .base import explain
from .checkpoint import (
    MARKER,
    SUBDIR,
    changed_since_marked,
    file_sha256,
    marker_path,
    rank_and_world,
    rank_state_path,
    read_marker,
    relative_path,
)
from .together import gather, world_group

__all__ = [
    "check_search_folder",
    "claim_output_dir",
    "mark_checkpoint_complete",
    "clear_completion_marker",
    "checkpoint_problem",
    "checkpoint_step",
    "find_resumable_checkpoint",
    "numbered_checkpoints",
    "on_rank_zero",
    "LOCK",
]

logger = logging.getLogger(__name__)

_FORMAT = 1  # the completion marker's
# in the output folder, held (flock) by the job writing there for the life of its process; a leading _: the Trainer's
# push_to_hub leaves it out
LOCK = "_birder.lock"
# the Trainer's folder names (accelerate's and Lightning's differ): ASCII digits without a leading zero, as the Trainer
# writes them (\d would read checkpoint-0012, or checkpoint-١٢ in Arabic-Indic digits, as step 12)
_CHECKPOINT = re.compile(r"^checkpoint-(0|[1-9][0-9]*)$")


def _checkpoint_files(checkpoint_dir: str, extra_files=()) -> dict[str, str]:
    """Every file of the checkpoint (``/``-separated relative path -> path), not the marker nor temporary files; and
    ``extra_files`` outside the folder (relative paths such as ``../x.ckpt``)."""
    files = {}
    for extra in extra_files:
        files[relative_path(extra, checkpoint_dir)] = extra
    for root, dirs, names in os.walk(checkpoint_dir):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            rel = relative_path(path, checkpoint_dir)
            if name.startswith(".tmp-") or rel == MARKER:
                continue
            files[rel] = path
    return files


def clear_completion_marker(checkpoint_dir: str) -> None:
    """Remove the completion marker of a checkpoint about to be written again (it is not complete until marked)."""
    try:
        os.unlink(marker_path(checkpoint_dir))
    except FileNotFoundError:
        pass


def mark_checkpoint_complete(
    checkpoint_dir: str,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    write: bool | None = None,
    failed: str | BaseException | None = None,
    extra_files=(),
    step: int | None = None,
) -> str | None:
    """Mark ``checkpoint_dir`` complete: call it on every rank once that rank has written all its files there.

    Collective when ``torch.distributed`` runs ``world_size`` ranks: one all-gather checks that every rank's Birder
    state is in place (each rank looks at its own file: per-node disks work). Then the writers (``write``; default:
    rank 0) write ``birder_complete.json`` atomically: the world size, and the size and SHA-256 of every file they see
    (each rank hashes its own state file; resume discovery and :func:`read_rank_state` check them). Raises
    ``RuntimeError`` naming the ranks whose file is missing. Returns the marker's path on the writers, else ``None``.

    ``failed``: why this rank could not write its files, a message or the exception itself (it still calls this, so
    that the others do not wait for it); every other rank then raises, naming it, and this rank raises its exception
    (a message: the same ``RuntimeError``). ``extra_files``: files of the checkpoint outside the folder that the
    writers list too (Lightning's ``.ckpt`` beside its ``.ckpt.birder`` folder). ``step``: the training step the
    checkpoint holds, recorded for resume discovery where names carry no step (Lightning's ``last.ckpt``).
    """
    rank, world_size = rank_and_world(rank, world_size)
    own = rank_state_path(checkpoint_dir, rank, world_size)
    mine = None if os.path.isfile(own) else f"rank {rank} has no {own}"
    # each rank hashes its own state (the largest files, in parallel); the writers hash the rest
    own_digest = file_sha256(own) if mine is None and failed is None else None
    writer = rank == 0 if write is None else write
    if mine is None and writer and os.path.isdir(marker_path(checkpoint_dir)):
        # found here, before the ranks agree: the write below would fail on this rank alone, after the others had gone
        # on to their next collective
        mine = f"rank {rank} cannot write {marker_path(checkpoint_dir)}: a directory is in its place"
    if failed is not None:
        why = f"{type(failed).__name__}: {failed}" if isinstance(failed, BaseException) else failed
        mine = f"rank {rank} failed to write its files ({why})"
    rows = gather((mine, own_digest), world_group(world_size))
    missing = [problem for problem, _ in rows if problem is not None]
    if missing:
        if isinstance(failed, BaseException):
            raise failed
        raise RuntimeError(
            f"Checkpoint {checkpoint_dir} was not marked complete: {'; '.join(missing)}. Every rank saves its Birder "
            "state (save_rank_state) before mark_checkpoint_complete; a resume will not choose this checkpoint."
        )
    if not writer:
        return None
    path = marker_path(checkpoint_dir)
    files = _checkpoint_files(checkpoint_dir, extra_files)
    ranks = range(world_size) if len(rows) == world_size else [rank]
    known = {
        relative_path(rank_state_path(checkpoint_dir, r, world_size), checkpoint_dir): d
        for r, (_, d) in zip(ranks, rows)
    }
    payload = {
        "format": _FORMAT,
        "world_size": world_size,
        "files": {rel: os.path.getsize(full) for rel, full in files.items()},
        "sha256": {rel: known.get(rel) or file_sha256(full) for rel, full in files.items()},
    }
    if step is not None:
        payload["step"] = int(step)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def checkpoint_problem(checkpoint_dir: str) -> str | None:
    """Why ``checkpoint_dir`` cannot be resumed from (no completion marker, a listed file missing, of another size or
    with other contents than when it was marked), or ``None`` if it is complete. Reads only the file system: every
    file the marker lists, once, for its SHA-256."""
    if not os.path.isfile(marker_path(checkpoint_dir)):
        return f"no {MARKER}: the job stopped while writing it, or it predates completion markers"
    try:
        with open(marker_path(checkpoint_dir), encoding="utf-8") as f:
            payload = json.load(f)
    except (OSError, ValueError) as exc:
        return f"its {MARKER} is unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT or not isinstance(payload.get("files"), dict):
        return f"its {MARKER} is not a birder_hf completion marker (format {_FORMAT})"
    for rel in sorted(payload["files"]):
        if not os.path.isfile(os.path.join(checkpoint_dir, *rel.split("/"))):
            return f"{rel} is missing"
    for rel in sorted(payload["files"]):
        changed = changed_since_marked(checkpoint_dir, rel, payload)
        if changed:
            return f"{rel} {changed}"
    return None


def checkpoint_step(checkpoint_dir: str) -> int | None:
    """The training step recorded in ``checkpoint_dir``'s completion marker (``None``: no marker, or none recorded)."""
    step = (read_marker(checkpoint_dir) or {}).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _newest_complete(where: str, candidates) -> str | None:
    # candidates: checkpoint folders, newest first; the first complete one wins, newer ones are named
    for path in candidates:
        problem = checkpoint_problem(path)
        if problem is None:
            logger.info("Resuming from %s, the newest checkpoint complete on every rank.", path)
            return path
        logger.warning("Not resuming from %s (%s); it is left as it is.", path, problem)
    logger.info("No complete checkpoint in %s: starting fresh.", where)
    return None


def numbered_checkpoints(output_dir: str, pattern: str | re.Pattern | None = None) -> list[tuple[int, str]]:
    """The folders of ``output_dir`` whose names ``pattern`` matches (its last group: the checkpoint's number), as
    ``(number, path)``, newest (highest number) first. Default: the Trainer's ``checkpoint-N``."""
    pattern = _CHECKPOINT if pattern is None else re.compile(pattern)
    found = []
    if os.path.isdir(output_dir):
        for name in os.listdir(output_dir):
            m = pattern.match(name)
            if m and os.path.isdir(os.path.join(output_dir, name)):
                found.append((int(m.group(pattern.groups)), os.path.join(output_dir, name)))
    return sorted(found, reverse=True)


def on_rank_zero(fn):
    # fn() on rank 0, its answer broadcast to every rank (one broadcast when torch.distributed runs several ranks)
    import torch.distributed as dist

    on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    answer = [None]
    if not on or dist.get_rank() == 0:
        answer[0] = fn()
    if on:
        dist.broadcast_object_list(answer, src=0)
    return answer[0]


def find_resumable_checkpoint(output_dir: str, *, pattern: str | re.Pattern | None = None) -> str | None:
    """The newest ``output_dir/checkpoint-N`` that is complete on every rank (:func:`checkpoint_problem`), or ``None``.

    What ``--resume_from_checkpoint auto`` resolves to. Newer incomplete folders are named in a warning and left
    alone. Collective when ``torch.distributed`` is initialized: rank 0's answer is every rank's (one broadcast).
    ``pattern``: which folders are checkpoints, its last group their number (:func:`numbered_checkpoints`).
    """
    check_search_folder(output_dir)
    return on_rank_zero(
        lambda: _newest_complete(output_dir, [path for _, path in numbered_checkpoints(output_dir, pattern)])
    )


def check_search_folder(folder: str) -> None:
    """Refuse a file, or a checkpoint itself, as the folder that holds the checkpoints (either meant a fresh start with
    one INFO line). Every rank checks its own file system, so every rank raises."""
    if os.path.isfile(folder):
        what = f"{folder} is a file, not the folder that holds the checkpoints"
        raise ValueError(explain(what, "pass that folder (its parent), or load this checkpoint directly"))
    if os.path.isdir(os.path.join(folder, SUBDIR)) or os.path.isfile(marker_path(folder)):
        what = f"{folder} is a checkpoint, not the folder that holds the checkpoints"
        parent = os.path.dirname(os.path.abspath(folder))
        raise ValueError(explain(what, f"pass its parent ({parent}), or load it directly"))


_HELD: dict[str, int] = {}  # real path of a folder -> the open file of the lock this process holds on it


def _take_lock(folder: str, wait_for_orphans: float = 60.0) -> str | None:
    """Take this process's exclusive lock on ``folder`` (``folder/_birder.lock``, ``fcntl.flock``): ``None`` when held
    (now or already), else why not. The operating system releases it when the process exits, however it exits."""
    real = os.path.realpath(folder)
    if real in _HELD:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(os.path.join(folder, LOCK), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        what = f"{folder} is not writable ({type(exc).__name__}: {exc}): the first checkpoint would fail there"
        return explain(what, "choose a writable output folder (or make this one writable)")
    try:
        import fcntl
    except ImportError:  # no flock (Windows): no lock
        _HELD[real] = fd
        return None
    deadline = time.monotonic() + wait_for_orphans
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = _lock_holder(fd)
            # a holder that died on this host leaves the lock to the children it forked (data loader workers) until
            # they notice: an elastic restart waits for them
            if _dead_here(holder) and time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            os.close(fd)
            who = ", ".join(f"{k} {holder[k]}" for k in ("host", "pid", "since", "running") if k in holder)
            what = f"{folder} is being written by another job ({who or 'unknown'}); two jobs writing one folder "
            what += "overwrite each other's checkpoints, and a resume then takes whichever wrote last"
            return explain(what, "give this job its own output folder, or wait for that job to end")
        except OSError as exc:  # a file system without locks (some network mounts): train on, unguarded
            os.close(fd)
            logger.warning("Cannot lock %s (%s): nothing stops a second job from writing there too.", folder, exc)
            return None
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    holder["running"] = " ".join(sys.argv)[:300]
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
    _HELD[real] = fd
    return None


def _lock_holder(fd: int) -> dict:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _dead_here(holder: dict) -> bool:
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def claim_output_dir(folder: str, *, holder: bool | None = None, world_size: int | None = None) -> None:
    """Claim ``folder`` (where this job writes its checkpoints) for this job, before it trains.

    Call it on every rank; the ``holder`` ranks (default: rank 0; the ranks that write the checkpoints, e.g. each
    node's first with per-node disks) create the folder if needed and lock ``folder/_birder.lock`` for the life of
    their process (``fcntl.flock``: released by the operating system however the process ends, so a restart after a
    crash finds it free). If another live job holds it, or the folder cannot be written, every rank raises
    ``RuntimeError`` together (one all-gather when ``torch.distributed`` runs ``world_size`` ranks), before anything
    is written: two jobs writing one folder overwrote each other's checkpoints without a word, and a read-only folder
    failed only at the first save. Claiming a folder this process holds already is free.
    """
    rank, world_size = rank_and_world(None, world_size)
    holder = rank == 0 if holder is None else holder
    mine = _take_lock(folder) if holder else None
    rows = gather(mine, world_group(world_size))
    problems = [f"rank {r}: {p}" if world_size > 1 else p for r, p in enumerate(rows) if p]
    if problems:
        raise RuntimeError("; ".join(problems))
