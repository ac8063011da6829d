"""The plumbing every communicator shares: collectives on a topology's groups with byte accounting (:class:`Wire`,
:class:`CommStats`), and calls on one topology run in call order (:func:`launch_in_order`)."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from .lifecycle import then
from .topology import Topology

__all__ = ["CommStats", "fp32_allreduce_bytes", "Wire", "Job", "launch_in_order", "check_device"]

# all_gather_single replaces the deprecated all_gather_into_tensor in torch >= 2.13.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def fp32_allreduce_bytes(numel: int, world_size: int) -> int:
    """What one rank sends in an fp32 ring all-reduce (DDP's default) of ``numel`` values: ``2(n-1)/n · 4 · numel``."""
    return round(2 * (world_size - 1) * 4 * numel / world_size)


@dataclass
class CommStats:
    """Bytes this rank SENT through the 1-bit all-reduce, split by link, next to the fp32 baseline.

    Accounting: an all-gather of ``P`` bytes among ``m`` ranks sends ``(m-1)·P`` (ring); an all-to-all
    with ``P`` bytes per peer sends ``(m-1)·P``. Collectives on the intra-node (inter-node) group count
    as intra (inter). A collective on the whole world with ``L`` ranks per node counts ``(L-1)·P`` as
    intra and ``(n-L)·P`` as inter: each peer's share, as if sent to it directly (a simple model; a
    ring sends all its bytes to one neighbour).
    """

    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    calls: int = 0  # onebit_all_reduce calls
    collectives: int = 0  # collectives launched (size-1 groups launch none)
    fp32_allreduce_bytes: int = 0  # what DDP's fp32 ring all-reduce would send: 2(n-1)/n · 4 · numel

    @property
    def total_bytes(self) -> int:
        return self.intra_node_bytes + self.inter_node_bytes

    @property
    def compression_ratio(self) -> float:
        """fp32 ring all-reduce bytes / 1-bit bytes (higher => less traffic); ``inf`` if nothing was sent."""
        if self.total_bytes == 0:
            return math.inf if self.fp32_allreduce_bytes else 0.0
        return self.fp32_allreduce_bytes / self.total_bytes

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def __iadd__(self, other: CommStats) -> CommStats:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_dict(self, prefix: str = "comm/") -> dict[str, float]:
        out = {prefix + f.name: getattr(self, f.name) for f in fields(self)}
        out[prefix + "compression_ratio"] = self.compression_ratio
        return out


def check_device(group, device: torch.device) -> None:
    """Raise ``ValueError`` if ``group``'s backend cannot run collectives on ``device``."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        ok = device.type in {part.split(":")[0] for part in backend.split(",")}
    elif backend == "nccl":
        ok = device.type == "cuda"
    elif backend == "gloo":
        ok = device.type == "cpu"  # gloo has no all-to-all for accelerator tensors
    else:
        ok = device.type != "meta"
    if not ok:
        fix = "move u to one the backend handles (nccl: cuda, gloo: cpu), or use backend='cpu:gloo,cuda:nccl'"
        raise ValueError(f"u is on {device} but the process group's backend is {backend!r}; {fix}.")


class Done:
    """The completed 'work' of a collective on a group of one rank."""

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


DONE = Done()


class Wire:
    """Collectives on a topology's groups (``"world"``, ``"intra"``, ``"inter"``), counted into ``stats``."""

    def __init__(self, topo: Topology, stats: CommStats | None):
        self.topo, self.stats = topo, stats

    def _scope(self, scope: str):
        t = self.topo
        if scope == "world":
            return t.world_group, t.world_size
        if scope == "intra":
            return t.intra_group, t.local_world_size
        return t.inter_group, t.num_nodes

    def _count(self, scope: str, size: int, per_peer: int) -> None:
        s = self.stats
        if s is None:
            return
        s.collectives += 1
        if scope == "world":
            lws = self.topo.local_world_size
            s.intra_node_bytes += round((lws - 1) * per_peer)
            s.inter_node_bytes += round((size - lws) * per_peer)
        elif scope == "intra":
            s.intra_node_bytes += round((size - 1) * per_peer)
        else:
            s.inter_node_bytes += round((size - 1) * per_peer)

    def all_gather(self, inp: torch.Tensor, scope: str):
        """Start an all-gather of ``inp``: ``(out, work)``, ``out`` holding every member's ``inp`` in rank order."""
        group, size = self._scope(scope)
        if size == 1:
            return inp, DONE
        out = torch.empty(size * inp.numel(), dtype=inp.dtype, device=inp.device)
        self._count(scope, size, inp.numel() * inp.element_size())
        return out, _all_gather(out, inp, group=group, async_op=True)

    def all_to_all(self, inp: torch.Tensor, scope: str):
        """Start an all-to-all: member ``i`` receives the ``i``-th equal slice of every member's ``inp``."""
        group, size = self._scope(scope)
        if size == 1:
            return inp, DONE
        out = torch.empty_like(inp)
        self._count(scope, size, inp.numel() * inp.element_size() // size)
        return out, dist.all_to_all_single(out, inp, group=group, async_op=True)

    def all_reduce_sum(self, buf: torch.Tensor, scope: str, per_peer: float):
        """Start an in-place sum all-reduce of ``buf``, counted as ``per_peer`` bytes sent to each peer."""
        group, size = self._scope(scope)
        if size == 1:
            return buf, DONE
        self._count(scope, size, per_peer)
        return buf, dist.all_reduce(buf, group=group, async_op=True)

    def all_reduce_max(self, buf: torch.Tensor, scope: str):
        """Start an in-place element-wise maximum all-reduce of ``buf`` (the ranks' agreement: not counted)."""
        group, size = self._scope(scope)
        if size == 1:
            return buf, DONE
        return buf, dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group, async_op=True)

    def all_gather_sync(self, inp: torch.Tensor, scope: str) -> torch.Tensor:
        out, work = self.all_gather(inp, scope)
        work.wait()
        return out


class Job:
    """A communicator's call on one topology: ``start(wire)`` launches the first collective and returns
    ``(recv, work)``; ``finish(wire, recv)`` runs the rest (blocking collectives allowed) and returns the result.

    Everything that may reference the process groups (the wire, and ``start``/``finish`` with what they close
    over) is dropped as soon as the job ends, on whatever thread that is, while the caller still holds the
    topology: a callback's closure dies later on the backend's thread, and if it held the last reference to the
    groups, their destructor would join that very thread ("Resource deadlock avoided", SIGABRT).
    """

    def __init__(self, wire: Wire, start: Callable, finish: Callable):
        self.wire, self._start, self._finish = wire, start, finish

    def _release(self) -> None:
        self.wire = self._start = self._finish = None

    def start(self):
        try:
            return self._start(self.wire)
        except BaseException:
            self._release()
            raise

    def finish(self, recv):
        try:
            return self._finish(self.wire, recv)
        finally:
            self._release()

    def run(self, after: torch.futures.Future | None = None):
        """Wait for ``after`` (re-raising its failure), then the whole job, synchronously."""
        try:
            if after is not None:
                after.wait()
            recv, work = self.start()
            work.wait()
        except BaseException:
            self._release()
            raise
        return self.finish(recv)


# Calls on one Topology run their collectives in call order, on every rank: a pending async call's
# successor starts only when it has finished. (On gloo, callbacks run on the backend's threads; two
# jobs interleaving their collectives in different orders on different ranks would mix them up.)
class _Queue:
    __slots__ = ("lock", "tail")

    def __init__(self):
        self.lock, self.tail = threading.Lock(), None


_QUEUES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_QUEUES_LOCK = threading.Lock()


def _queue(topo: Topology) -> _Queue:
    with _QUEUES_LOCK:
        q = _QUEUES.get(topo)
        if q is None:
            q = _QUEUES[topo] = _Queue()
        return q


def launch_in_order(topology: Topology, job: Job, *, async_op: bool = True):
    """Run ``job`` after every earlier call on ``topology``; a Future of its result (``async_op``) or the result."""
    topology.check_open()
    queue = _queue(topology)
    if not async_op:
        with queue.lock:
            tail = queue.tail
        return job.run(tail if tail is not None and not tail.done() else None)
    with queue.lock:
        tail = queue.tail
        if tail is None or tail.done():
            recv, work = job.start()
            fut = then(work.get_future(), lambda f: (f.wait(), job.finish(recv))[1])
        else:
            fut = then(tail, job.run)  # job.run re-raises a failure of the calls before it
        queue.tail = fut
    return fut
