"""The ranks' agreement on a call of the 1-bit all-reduce, checked once per signature and then cached.

Ranks that call onebit_all_reduce with different sizes or methods would launch collectives that do not match:
gloo aborts a rank or returns garbage, NCCL hangs until the process-group timeout. The first call with a new
signature therefore exchanges it (one all-gather of a few int64) and every rank raises the same ValueError if
they differ; later calls with that signature only look it up in a small per-group cache.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

from .base import explain
from .settings import INTER_METHODS, METHODS
from .topology import Topology
from .wire import Wire

__all__ = ["signature_of", "needs_check", "check_signature"]  # the public door is collectives.check_agreement

_SIGNATURE = ("numel", "method", "inter_method", "chunk_numel", "dtype", "num_nodes", "local_world_size")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_AGREED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # world group -> signatures agreed (LRU)
_AGREED_LOCK = threading.Lock()
_AGREED_MAX = 1024  # signatures remembered per group (every rank forgets the same ones: the same call sequence)


def signature_of(topo: Topology, numel: int, method: str, inter_method: str, step: int, dtype) -> tuple[int, ...]:
    """What every rank's call must share, as int64s (``step``: the elements per round when chunked, else 0)."""
    return (
        numel,
        METHODS.index(method),
        INTER_METHODS.index(inter_method),
        step,
        _DTYPES.index(dtype) if dtype in _DTYPES else -1,
        topo.num_nodes,
        topo.local_world_size,
    )


def needs_check(topo: Topology, signature: tuple) -> bool:
    """Whether this call must check ``signature`` with the other ranks: ``True`` on its first use on the topology's
    world group, which also records it (decided at call time, so every rank decides alike whatever the timing)."""
    if topo.world_size == 1:
        return False
    with _AGREED_LOCK:
        seen = _AGREED.get(topo.world_group)
        if seen is None:
            seen = _AGREED[topo.world_group] = OrderedDict()
        if signature in seen:
            seen.move_to_end(signature)
            return False
        seen[signature] = None
        if len(seen) > _AGREED_MAX:
            seen.popitem(last=False)
        return True


def check_signature(topo: Topology, signature: tuple, device: torch.device) -> None:
    """Exchange ``signature`` with every rank of the topology; all raise the same ``ValueError`` if they differ."""
    mine = torch.tensor(signature, dtype=torch.int64, device=device)
    table = Wire(topo, None).all_gather_sync(mine, "world")  # not counted: no bytes of the all-reduce
    rows = table.view(topo.world_size, -1).tolist()
    if all(row == rows[0] for row in rows):
        return
    with _AGREED_LOCK:  # not agreed after all: a later call with it checks again
        _AGREED.get(topo.world_group, {}).pop(signature, None)
    names = {1: METHODS, 2: INTER_METHODS, 4: tuple(str(d).replace("torch.", "") for d in _DTYPES)}
    differ = []
    for i, field in enumerate(_SIGNATURE):
        values = [row[i] for row in rows]
        if len(set(values)) > 1:
            shown = [names[i][v] if i in names and 0 <= v < len(names[i]) else v for v in values]
            if i == 3:
                shown = [v if v else "None" for v in shown]
            differ.append(f"{field}: " + ", ".join(f"rank {r} {v}" for r, v in enumerate(shown)))
    what = f"onebit_all_reduce: the ranks called it with different arguments ({'; '.join(differ)}); nothing was sent"
    fix = "pass u of the same number of elements and dtype, the same method and settings, and the same layout"
    raise ValueError(explain(what, fix))
