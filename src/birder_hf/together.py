"""Every rank fails together: one exchange, after which every rank judges the same table.

A check that fails on one rank only (a bad argument, a missing or corrupt file, a folder another job holds) must
stop every rank at once, with the same error: a rank that raised alone left the others waiting in their next
collective until the process-group timeout (NCCL: a hang). So each such check runs on every rank, the ranks exchange
what they found (one ``all_gather_object``), and every rank decides from the same rows.

- :func:`gather`: the exchange: every rank's row, in rank order;
- :func:`raise_together`: every rank's error (or ``None``) and payload; if any rank failed, every rank raises the
  lowest failed rank's error, of the same type and with the same message (:data:`SHARED_ERRORS`);
- :func:`world_group`: the group to exchange over when the caller knows the world size it expects (the Trainer's,
  accelerate's, Lightning's), ``None`` where ``torch.distributed`` does not run those ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

__all__ = ["SHARED_ERRORS", "gather", "raise_together", "world_group"]

# the types every rank re-raises as they are; any other one becomes a RuntimeError whose message starts with its name
SHARED_ERRORS = {e.__name__: e for e in (ValueError, TypeError, RuntimeError, FileNotFoundError)}


def world_group(world_size: int | None):
    """The default group if ``torch.distributed`` runs ``world_size`` > 1 ranks, else ``None`` (nothing to ask)."""
    if world_size is None or world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.group.WORLD if dist.get_world_size() == world_size else None


def gather(row, group) -> list:
    """Every rank's ``row`` in rank order (one ``all_gather_object`` over ``group``, which every member calls at the
    same point); ``[row]`` where ``group`` is ``None``, has one rank, or does not hold this rank (nobody waits)."""
    if group is None or dist.get_rank(group) < 0 or dist.get_world_size(group) == 1:
        return [row]
    table: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(table, row, group=group)
    return table


def raise_together(
    error: BaseException | None, group, payload=None, *, describe: Callable[[int, str], str] | None = None
) -> list:
    """Exchange this rank's ``error`` (``None``: its checks passed) and ``payload`` with every rank of ``group``.

    If any rank failed, every rank raises the error of the lowest failed rank ``r``: its type if
    :data:`SHARED_ERRORS` holds it (else ``RuntimeError``, the type's name before the message), its message rewritten
    by ``describe(r, message)`` (default: ``"rank r: "`` before it, unless every rank failed alike), and this rank's
    own ``error`` as its cause. Otherwise returns every rank's ``payload``, in rank order. A collective
    over ``group`` (see :func:`gather`): every member calls it at the same point, even after its own failure. With
    nobody to ask, this rank's ``error`` is raised as it is.
    """
    row = (None, None, payload) if error is None else (type(error).__name__, str(error), None)
    table = gather(row, group)
    if len(table) == 1 and error is not None:
        raise error
    failed = [(r, kind, message) for r, (kind, message, _) in enumerate(table) if kind is not None]
    if not failed:
        return [p for _, _, p in table]
    r, kind, message = failed[0]
    alike = len(failed) == len(table) and all((k, m) == (kind, message) for _, k, m in failed)
    cls = SHARED_ERRORS.get(kind)
    if cls is None:
        cls, message = RuntimeError, f"{kind}: {message}"
    if describe is not None:
        message = describe(r, message)
    elif not alike:
        message = f"rank {r}: {message}"
    raise cls(message) from error
