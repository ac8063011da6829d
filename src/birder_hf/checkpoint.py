"""Per-rank checkpoints of Birder's optimizer state.

Birder's ``m`` and ``b`` are EMAs of each rank's *own* gradients, so they differ between ranks
(``docs/ALGORITHM.md``). Frameworks save only rank 0's optimizer state and load it on every rank; a
resume through that path would silently give every rank rank 0's ``m`` and ``b``, which changes the
run. So every rank writes its own full ``optimizer.state_dict()`` next to the framework's files:

    <checkpoint>/birder/rank_00000-of-00004.pt, rank_00001-of-00004.pt, ...

and loads its own on resume. (``birder_hf.local_steps.LocalSteps`` saves its per-rank state the same way: between outer
steps every rank's weights and inner optimizer differ.) What is saved: every tensor and number of the optimizer state
(``step``, ``exp_avg``, ``exp_avg_abs``, ``max_exp_avg_abs``) and the param groups, including the ``seed`` of the
counter-based random bits; nothing else is rank-local (the bits are a function of seed, step,
parameter and rank), so a resume continues bit for bit. Files hold plain tensors and numbers and
load with ``torch.load(weights_only=True)``. They are written to a temporary file, flushed to disk and
renamed into place, so a crash never leaves a half-written file under the final name.

Resuming with another world size is allowed on purpose: rank ``r`` loads the state of saved rank
``r mod old_world_size`` and a warning says so. Every saved state is a valid estimate of the same
gradient statistics; only the per-rank history changes. A missing or unreadable file for the current
layout is an error, never a silent reset.

Whether a checkpoint is complete on every rank, and which one a restart resumes from: ``birder_hf.elastic``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import numbers
import os
import re
import shutil
import tempfile
import warnings

import torch

from .base import OneBitOptimizer, explain, unwrap_optimizer
from .together import raise_together, world_group

__all__ = [
    "save_rank_state",
    "load_rank_state",
    "read_rank_state",
    "read_own_rank_state",
    "rank_state_path",
    "rank_and_world",
    "disk_full_error",
    "file_sha256",
    "marker_path",
    "read_marker",
    "changed_since_marked",
    "relative_path",
    "SUBDIR",
    "MARKER",
]

SUBDIR = "birder"
MARKER = "birder_complete.json"  # birder_hf.elastic's completion marker, in the checkpoint folder; written last
_FORMAT = 1
_NAME = re.compile(r"^rank_(\d{5})-of-(\d{5})\.pt$")


def rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)``, checked; ``None``: torch.distributed's (0 and 1 where it does not run)."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        on = dist.is_available() and dist.is_initialized()
        rank = (dist.get_rank() if on else 0) if rank is None else rank
        world_size = (dist.get_world_size() if on else 1) if world_size is None else world_size
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"Invalid {name}={value!r}: {name} must be an int.")
    if world_size < 1 or not 0 <= rank < world_size:
        what = f"Invalid rank={rank!r} with world_size={world_size!r}: a rank lies in [0, world_size)"
        fix = "pass accelerator.process_index and num_processes, or leave both None (torch.distributed's)"
        raise ValueError(explain(what, fix))
    return int(rank), int(world_size)


def _owner(optimizer, where: str):
    # whose per-rank state: a birder-hf optimizer (in any framework's wrapper), or a birder_hf.local_steps.LocalSteps
    opt = unwrap_optimizer(optimizer)
    if not isinstance(opt, OneBitOptimizer) and not all(
        callable(getattr(opt, name, None)) for name in ("state_dict", "check_state_dict", "load_own_state_dict")
    ):
        model = " (a model? pass the optimizer)" if isinstance(opt, torch.nn.Module) else ""
        what = f"{where} takes a birder_hf Birder or OneBitAdam optimizer or a LocalSteps"
        raise TypeError(f"{what}, got {type(opt).__name__}{model}.")
    return opt


def rank_state_path(checkpoint_dir: str, rank: int, world_size: int) -> str:
    return os.path.join(checkpoint_dir, SUBDIR, f"rank_{rank:05d}-of-{world_size:05d}.pt")


def save_rank_state(optimizer, checkpoint_dir: str, *, rank: int | None = None, world_size: int | None = None) -> str:
    """Write this rank's optimizer state under ``checkpoint_dir/birder/`` atomically; return the path.

    A failed write leaves the previous file of that name as it was. On a full disk the error is an
    ``OSError(ENOSPC)`` that says so, with the bytes needed and free, and names the file that was kept.
    """
    opt = _owner(optimizer, "save_rank_state")
    rank, world_size = rank_and_world(rank, world_size)
    path = rank_state_path(checkpoint_dir, rank, world_size)
    payload = {"format": _FORMAT, "rank": rank, "world_size": world_size, "optimizer": opt.state_dict()}
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=os.path.dirname(path))
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if not isinstance(exc, Exception):  # KeyboardInterrupt: nothing to explain
            raise
        kept = f"the previous {path} is unchanged" if os.path.exists(path) else f"nothing was written to {path}"
        full = disk_full_error(exc, os.path.dirname(path), _nbytes(payload), kept)
        if full is not None:
            raise full from exc
        exc.add_note(f"birder_hf: writing this rank's optimizer state failed; {kept}.")
        raise
    return path


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 8


def disk_full_error(exc: BaseException, folder: str, needed: int | None = None, kept: str = "") -> OSError | None:
    """An ``OSError(ENOSPC)`` that says the disk holding ``folder`` is full, if that is why writing failed with
    ``exc`` (its errno, or fewer than ``needed`` bytes free now, 1 MiB if unknown); else ``None``. ``kept`` says
    what was kept.

    torch's writer loses the errno of a full disk ("unexpected pos 1408 vs 1300"), hence the free-space test.
    """
    cause, codes = exc, set()
    while cause is not None:
        codes.add(getattr(cause, "errno", None))
        cause = cause.__cause__ or cause.__context__
    existing = os.path.abspath(folder)
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)  # the folder itself may not have been made
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return None
    if not codes & {errno.ENOSPC, errno.EDQUOT} and free >= (needed or 1 << 20):
        return None
    need = f"; this write needs about {needed}" if needed else ""
    kept = f"{kept[:1].upper()}{kept[1:]}. " if kept else ""
    return OSError(
        errno.ENOSPC,
        f"The disk holding {folder} is full ({free} bytes free{need}): {type(exc).__name__}: {exc}. {kept}Free some "
        "space (or checkpoint to another disk) and save again.",
    )


def _saved_world_size(checkpoint_dir: str) -> int | None:
    folder = os.path.join(checkpoint_dir, SUBDIR)
    if not os.path.isdir(folder):
        return None
    worlds = {int(m.group(2)) for m in map(_NAME.match, os.listdir(folder)) if m}
    if len(worlds) > 1:
        raise RuntimeError(f"{folder} holds Birder states of several world sizes {sorted(worlds)}; keep one set.")
    return worlds.pop() if worlds else None


def read_rank_state(
    checkpoint_dir: str, *, rank: int | None = None, world_size: int | None = None, map_location="cpu"
) -> dict:
    """Read (and validate) the optimizer state dict this rank must resume from."""
    rank, world_size = rank_and_world(rank, world_size)
    saved_world = _saved_world_size(checkpoint_dir)
    if saved_world is None:
        what = f"No Birder per-rank optimizer state under {os.path.join(checkpoint_dir, SUBDIR)} (it is rank-local)"
        fix = "resume from a checkpoint birder_hf saved (save_rank_state), or start a fresh run"
        raise FileNotFoundError(explain(what, fix))
    source = rank if saved_world == world_size else rank % saved_world
    if saved_world != world_size:
        message = f"Resuming Birder with world size {world_size} from a checkpoint of world size {saved_world}: rank "
        message += f"{rank} takes the optimizer state of saved rank {source} (no longer bit for bit an unbroken run)."
        warnings.warn(message, UserWarning, stacklevel=2)
    path = rank_state_path(checkpoint_dir, source, saved_world)
    if not os.path.exists(path):
        raise FileNotFoundError(f"Birder state {path} is missing (an incomplete checkpoint of {saved_world} ranks).")
    changed = changed_since_marked(checkpoint_dir, relative_path(path, checkpoint_dir))
    if changed:
        raise RuntimeError(f"Birder state {path} {changed}: resume from another checkpoint, or save this one again.")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise RuntimeError(f"Birder state {path} is corrupt: {type(exc).__name__}: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT or "optimizer" not in payload:
        raise RuntimeError(f"Birder state {path} is not a birder_hf per-rank state (format {_FORMAT}).")
    if payload["rank"] != source or payload["world_size"] != saved_world:
        raise RuntimeError(f"Birder state {path} claims rank {payload['rank']} of {payload['world_size']}; renamed?")
    return payload["optimizer"]


def read_own_rank_state(optimizer, checkpoint_dir: str, *, rank: int | None = None, world_size: int | None = None):
    """:func:`read_rank_state`, checked against ``optimizer`` (what its ``load_state_dict`` would refuse), on every
    rank together: if any rank's file is missing, unreadable or does not fit, every rank raises that rank's error
    (one all-gather), instead of the others waiting for it in the framework's next collective until the timeout.
    Returns this rank's state dict; the integrations' load paths use it."""
    opt = _owner(optimizer, "read_own_rank_state")
    rank, world_size = rank_and_world(rank, world_size)
    state, failure = None, None
    try:
        state = read_rank_state(checkpoint_dir, rank=rank, world_size=world_size)
        opt.check_state_dict(state)
    except Exception as exc:  # reported to every rank below
        failure = exc
    describe = lambda r, message: f"rank {r} of {world_size} could not load its Birder state: {message}"  # noqa: E731
    raise_together(failure, world_group(world_size), describe=describe)
    return state


def load_rank_state(optimizer, checkpoint_dir: str, *, rank: int | None = None, world_size: int | None = None) -> None:
    """Load this rank's own optimizer state from ``checkpoint_dir/birder/`` (see the module docstring).

    Collective when ``torch.distributed`` runs ``world_size`` ranks: if one rank's file is missing or corrupt, every
    rank raises (:func:`read_own_rank_state`)."""
    opt = _owner(optimizer, "load_rank_state")
    opt.load_own_state_dict(read_own_rank_state(opt, checkpoint_dir, rank=rank, world_size=world_size))


# ----------------------------------------------------------------------- a file against the completion marker
# (birder_hf.elastic writes the marker; a per-rank file changed since it was marked is refused when read)


def marker_path(checkpoint_dir: str) -> str:
    return os.path.join(checkpoint_dir, MARKER)


def relative_path(path: str, checkpoint_dir: str) -> str:
    return os.path.relpath(os.path.abspath(path), os.path.abspath(checkpoint_dir)).replace(os.sep, "/")


def file_sha256(path: str) -> str:
    """The SHA-256 of a file's bytes (hex), read in 8 MiB blocks: what the completion marker records of every file."""
    digest = hashlib.sha256()
    block = bytearray(1 << 23)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            digest.update(view[:n])
    return digest.hexdigest()


def read_marker(checkpoint_dir: str) -> dict | None:
    try:
        with open(marker_path(checkpoint_dir), encoding="utf-8") as f:
            payload = json.load(f)
    except (OSError, ValueError):
        return None
    return payload if isinstance(payload, dict) else None


def changed_since_marked(checkpoint_dir: str, rel: str, marker: dict | None = None) -> str | None:
    """How ``rel`` differs from what the completion marker recorded of it (size, then SHA-256), or ``None`` (the
    same, or not recorded: a checkpoint without a marker, or marked before markers recorded digests)."""
    marker = read_marker(checkpoint_dir) if marker is None else marker
    if marker is None:
        return None
    full = os.path.join(checkpoint_dir, *rel.split("/"))
    sizes, digests = (marker.get(key) if isinstance(marker.get(key), dict) else {} for key in ("files", "sha256"))
    size = sizes.get(rel)
    if size is not None and os.path.getsize(full) != size:
        return f"has {os.path.getsize(full)} bytes, {size} when it was marked complete"
    digest = digests.get(rel)
    if digest is not None and file_sha256(full) != digest:
        return "was changed after it was marked complete (its SHA-256 differs from the one recorded)"
    return None
