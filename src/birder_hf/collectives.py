"""The 1-bit all-reduce of Birder: flat (``allgather``, ``scatter_gather``) and Hierarchical-1-bit-All-Reduce.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB
Official code: https://openi.pcl.ac.cn/c2net_optim/Birder
Deviations from the paper (reconstructed: the paper's code was not available to us):
    - every random draw is counter-based (``quantize.BitKeys``: seed, step, parameter, element index,
      stage, worker or node), so bits do not depend on bucket layout, chunking or shard ownership;
    - ``hierarchical`` step 1 exchanges the workers' votes inside a node as packed bits with an
      all-to-all (1 bit per element) instead of an int8 reduce-scatter of vote sums: 8x fewer
      intra-node bytes, exact all the same, and async-capable on gloo (which has no async
      reduce-scatter);
    - with ``inter_method="allgather"`` the exact mean of the k node bits is kept (no re-quantization):
      step 4 shares it inside the node as the vote counts' binary digits, ``bit_length(k)`` bits per
      element (k = 1: 1 bit, k = 2, 3: 2 bits, k = 4..7: 3 bits);
    - on one node (k = 1), ``hierarchical`` keeps the exact mean of the L votes (as ``allgather`` for L <= 4,
      else step 4 shares their counts) instead of re-quantizing it to 1 bit: nothing crosses nodes, so there is
      nothing to save;
    - antithetic pairs (``quantize.antithetic``): ranks ``2i`` and ``2i+1`` quantize with one shared random
      variate per element, the odd one reflected, and so do nodes ``2i`` and ``2i+1`` when they re-quantize their
      node means (a last, unpaired rank or node draws alone). Each vote keeps its law, so ``E[d]`` is unchanged.
      The variance of ``d`` never exceeds that of independent draws: ``d`` is either one ±1 bit (``scatter_gather``,
      ``inter_method="scatter_gather"``: ``Var(d) = 1 - E[d]^2`` whatever the coupling) or the mean of ±1 votes
      or node bits ``X``, whose variances ``1 - E[X]^2`` do not depend on the coupling either, and whose
      covariances are all ``<= 0``: every ``X`` is non-decreasing in the votes it is made of, and each shared
      variate enters its pair's two draws one non-increasing, one non-decreasing; conditioning on every other
      variate, Chebyshev's sum inequality gives a covariance ``<= 0`` and the conditional means, functions of
      independent variates, covary by 0 (one shared variate at a time, by the law of total covariance). A
      coordinate whose ``u`` is 0 on every rank (a gradient that has been 0 everywhere since the start: BERT's
      padding row, unseen vocabulary) gets ``d = 0`` exactly from ``allgather`` with an even world size, from
      ``hierarchical`` on one node of an even ``L``, and across ``k`` nodes with ``inter_method="allgather"`` when
      ``k`` is even (or 1) and ``L`` is even (or 1): pairs of zero votes cancel, so node means are 0, and pairs
      of zero node means cancel again. Methods whose result is one ±1 bit cannot express 0, and an odd number
      of ranks (or nodes) leaves one fair coin: ``d = ±1/n`` (or ``±1/k``); ``docs/ALGORITHM.md`` lists what remains;
    - received votes are never unpacked: fused kernels (``quantize.votes_mean_``, ``digits_mean_``,
      ``requantize_pack``) count them straight from the packed bytes and write the mean, or its re-quantized
      bits, in one pass; step 4's vote counts are made bit-sliced (a ripple-carry adder over the bytes).

Each method returns ``d``, identical bit for bit on every rank, with ``E[d] = mean_r u_r`` (up to the
``2^-23`` codec bias): every draw that other ranks depend on is made on exactly one rank and then
shared as bits.

This module holds the all-reduce's three parts, in order: the wire (collectives on a topology's groups with byte
accounting, calls in call order: :class:`Wire`, :class:`CommStats`, :func:`launch_in_order`), the ranks' agreement on
a call (once per signature), and the all-reduce itself (one plan per method). The settings live in ``settings.py``,
the callbacks' and process groups' lifecycle in ``lifecycle.py``.
"""

from __future__ import annotations

import math
import numbers
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from .base import explain
from .lifecycle import then
from .quantize import (
    STAGE_INTER_SHARD,
    STAGE_NODE,
    STAGE_SHARD,
    STAGE_WORKER,
    BitKeys,
    antithetic,
    digits_mean_,
    unpack_bits,
    votes_mean_,
)
from .settings import DEFAULT_INTER_METHOD, DEFAULT_METHOD, INTER_METHODS, METHODS, CommSettings, check_settings
from .topology import Topology

__all__ = [
    "onebit_all_reduce",
    "check_agreement",
    "expected_bytes",
    "CommStats",
    "fp32_allreduce_bytes",
    "Wire",
    "Job",
    "launch_in_order",
    "check_device",
    "own_votes",
]


# ------------------------------------------------------------------------------------------------------ the wire
# The plumbing every communicator shares: collectives on a topology's groups with byte accounting (:class:`Wire`,
# :class:`CommStats`), and calls on one topology run in call order (:func:`launch_in_order`).

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


# --------------------------------------------------------------------------------------- the agreement on a call
# The ranks' agreement on a call of the 1-bit all-reduce, checked once per signature and then cached.
#
# Ranks that call onebit_all_reduce with different sizes or methods would launch collectives that do not match:
# gloo aborts a rank or returns garbage, NCCL hangs until the process-group timeout. The first call with a new
# signature therefore exchanges it (one all-gather of a few int64) and every rank raises the same ValueError if
# they differ; later calls with that signature only look it up in a small per-group cache.

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


# ------------------------------------------------------------------------------------------ the 1-bit all-reduce
def _count_planes(rows: torch.Tensor) -> torch.Tensor:
    """The vote counts of ``m`` packed rows ``(m, P)``, as ``m.bit_length()`` packed binary digits ``(B, P)``.

    A bit-sliced ripple-carry adder on the packed bytes: about ``2·m·log2(m)`` byte ops on ``P = numel/8``
    bytes; nothing is unpacked.
    """
    m = rows.shape[0]
    if m == 1:
        return rows
    planes = rows.new_zeros(m.bit_length(), rows.shape[1])
    for i, row in enumerate(rows):
        carry = row
        for j in range((i + 1).bit_length()):  # after i+1 rows the count fits in that many bits
            nxt = planes[j] & carry
            planes[j] ^= carry
            carry = nxt
    return planes


class _Plan:
    """One ``onebit_all_reduce`` call: this rank's packed votes and where ``d`` goes, chunk by chunk. One subclass
    per method: ``start`` runs stage 1 of elements ``[c0, c1)`` (the exchange of this rank's votes), ``finish`` the
    stages after it."""

    def __init__(self, topo: Topology, inter_method: str, keys: BitKeys, packed, out):
        self.topo, self.inter_method = topo, inter_method
        self.keys, self.packed, self.out = keys, packed, out

    def _write(self, c0: int, c1: int, rows: torch.Tensor) -> None:
        # the exact mean of the votes in rows (m, P) for elements [c0, c1) (m = 1: the +-1 bits themselves)
        votes_mean_(self.out[c0 : min(c1, self.out.numel())], rows)

    def _write_counts(self, wire, c0: int, shard: int, planes: torch.Tensor, m: int) -> None:
        # every local rank holds the vote counts (of m votes) of its shard as binary digits: gather them inside
        # the node, and write each shard's exact mean (local rank i's shard: elements c0 + i·shard ...)
        lws = self.topo.local_world_size
        full = wire.all_gather_sync(planes.reshape(-1), "intra").view(lws, planes.shape[0], -1)
        for i, block in enumerate(full):
            lo = min(c0 + i * shard, self.out.numel())
            digits_mean_(self.out[lo : min(lo + shard, self.out.numel())], block, m)


class _AllGather(_Plan):
    name = "allgather"

    @staticmethod
    def alignment(n: int, lws: int, k: int, inter_method: str) -> int:
        return 8  # elements per chunk must split into whole bytes for every shard of every stage

    @staticmethod
    def sent(d: int, n: int, lws: int, k: int, inter_method: str) -> tuple[int, int]:
        return (lws - 1) * (d // 8), (n - lws) * (d // 8)  # (intra, inter) bytes for d (padded) elements

    def start(self, wire: Wire, c0: int, c1: int):
        return wire.all_gather(self.packed[c0 // 8 : c1 // 8], "world")

    def finish(self, wire: Wire, c0: int, c1: int, recv: torch.Tensor) -> None:
        self._write(c0, c1, recv.view(self.topo.world_size, -1))


class _ScatterGather(_Plan):
    name = "scatter_gather"

    @staticmethod
    def alignment(n: int, lws: int, k: int, inter_method: str) -> int:
        return 8 * n

    @staticmethod
    def sent(d: int, n: int, lws: int, k: int, inter_method: str) -> tuple[int, int]:
        per_peer = 2 * d // (8 * n)
        return (lws - 1) * per_peer, (n - lws) * per_peer

    def start(self, wire: Wire, c0: int, c1: int):
        return wire.all_to_all(self.packed[c0 // 8 : c1 // 8], "world")

    def finish(self, wire: Wire, c0: int, c1: int, recv: torch.Tensor) -> None:
        n, r = self.topo.world_size, self.topo.rank
        shard = (c1 - c0) // n
        # average the n votes of my shard, re-quantize it (one draw, made on this rank only), share the bits
        bits = self.keys.requantize_pack(recv.view(n, -1), c0 + r * shard, STAGE_SHARD, 0) if n > 1 else recv
        self._write(c0, c1, wire.all_gather_sync(bits, "world").view(1, -1))


class _Hierarchical(_Plan):
    name = "hierarchical"

    @staticmethod
    def alignment(n: int, lws: int, k: int, inter_method: str) -> int:
        return 8 * lws * (k if inter_method == "scatter_gather" else 1)

    @staticmethod
    def sent(d: int, n: int, lws: int, k: int, inter_method: str) -> tuple[int, int]:
        shard = d // lws  # elements per node shard
        intra = (lws - 1) * shard // 8  # step 1: all-to-all of the votes
        if k == 1:  # one node: the exact vote counts of L votes, bit_length(L) bits per element
            inter, step4 = 0, lws.bit_length() * shard // 8
        elif inter_method == "allgather":
            inter = (k - 1) * shard // 8
            step4 = k.bit_length() * shard // 8  # the vote counts' binary digits
        else:
            inter = 2 * (k - 1) * (shard // k) // 8
            step4 = shard // 8
        return intra + (lws - 1) * step4, inter

    def start(self, wire: Wire, c0: int, c1: int):
        if self.topo.local_world_size == 1 and self.topo.num_nodes > 1:
            # one rank per node: no step 1, and the vote is already the node's bit. Start step 3 here, so that it
            # runs asynchronously: a finished step 1 would run finish(), and its blocking inter-node exchange, in the
            # caller (the DDP hook, inside backward)
            return self._inter(wire, self.packed[c0 // 8 : c1 // 8])
        return wire.all_to_all(self.packed[c0 // 8 : c1 // 8], "intra")

    def _inter(self, wire: Wire, node_bits: torch.Tensor):
        # 3) allgather: every rank of my column gets all k node bits of the shard (their exact mean, no draw);
        # scatter_gather: my sub-shard's k node bits
        return (wire.all_gather if self.inter_method == "allgather" else wire.all_to_all)(node_bits, "inter")

    def finish(self, wire: Wire, c0: int, c1: int, recv: torch.Tensor) -> None:
        t = self.topo
        lws, k, j, g = t.local_world_size, t.num_nodes, t.local_rank, t.node_rank
        shard = (c1 - c0) // lws
        if k == 1:
            # one node: nothing crosses nodes, so keep the exact mean of the L votes (no re-quantization, which
            # would double the variance of d); share it inside the node as its vote counts' binary digits
            self._write_counts(wire, c0, shard, _count_planes(recv.view(lws, -1)), lws)
            return
        if lws == 1:  # start() ran step 3 (with L == 1 the vote is the node's bit: re-quantizing it changes nothing)
            received = recv
        else:
            # 1-2) node mean of my node shard from the L votes, re-quantized to 1 bit by this rank only
            # (nodes 2i, 2i+1 draw as an antithetic pair: where both node means are 0 their bits cancel)
            who, reflect = antithetic(g)
            node_bits = self.keys.requantize_pack(recv.view(lws, -1), c0 + j * shard, STAGE_NODE, who, reflect=reflect)
            received, work = self._inter(wire, node_bits)
            work.wait()
        if self.inter_method == "allgather":
            # 4) share the mean of the k node bits inside the node as its vote counts: bit_length(k) packed bits
            self._write_counts(wire, c0, shard, _count_planes(received.view(k, -1)), k)
        else:
            # 3) my sub-shard's k node bits, re-quantized once
            sub = shard // k
            mine = received
            if k > 1:
                mine = self.keys.requantize_pack(mine.view(k, -1), c0 + j * shard + g * sub, STAGE_INTER_SHARD, 0)
            shard_bits = wire.all_gather_sync(mine, "inter")
            # 4) intra-node all-gather of the +-1 shard results
            self._write(c0, c1, wire.all_gather_sync(shard_bits, "intra").view(1, -1))


_PLANS = {plan.name: plan for plan in (_AllGather, _ScatterGather, _Hierarchical)}


def _plan_for(method: str, lws: int, k: int) -> type[_Plan]:
    # One node: hierarchical gives the exact vote mean, as allgather does (bit for bit). Sharing the vote counts
    # costs (L-1)/L·d/8·(1 + bit_length(L)) bytes against allgather's (L-1)·d/8: fewer only from L = 5 ranks on.
    if method == "hierarchical" and k == 1 and 1 + lws.bit_length() >= lws:
        return _AllGather
    return _PLANS[method]


def _layout(topo: Topology, numel: int, comm: CommSettings):
    """A call's plan class, its padded length, its elements per round and its signature's chunking field (the
    elements per round when chunked and not empty, else 0)."""
    plan = _plan_for(comm.method, topo.local_world_size, topo.num_nodes)
    align = plan.alignment(topo.world_size, topo.local_world_size, topo.num_nodes, comm.inter_method)
    padded = -(-numel // align) * align
    if comm.chunk_numel is None or not padded:
        return plan, padded, padded, 0
    step = max(align, int(comm.chunk_numel) // align * align)  # whole bytes of every shard, at least one
    return plan, padded, step, step


def expected_bytes(method: str, numel: int, topology, *, inter_method: str = DEFAULT_INTER_METHOD) -> dict[str, int]:
    """Bytes one rank sends for ``numel`` elements, made exact for padding.

    ``topology`` is a :class:`Topology` or a ``(num_nodes, local_world_size)`` tuple. Returns
    ``intra_node_bytes``, ``inter_node_bytes`` and ``fp32_allreduce_bytes`` (same accounting as
    :class:`CommStats`; independent of ``chunk_numel``). With ``d = numel`` (padded), ``n`` ranks,
    ``k`` nodes of ``L``:

    - allgather: ``(n-1)·d/8`` (intra ``(L-1)·d/8``, inter ``(n-L)·d/8``);
    - scatter_gather: ``2(n-1)/n·d/8`` split the same way;
    - hierarchical: inter ``(k-1)·d/(8L)`` (``inter_method="allgather"``) or ``2(k-1)/k·d/(8L)``
      (``"scatter_gather"``); intra ``(L-1)/L·d/8`` (step 1) plus step 4: ``(L-1)/L·d/8`` for the ±1
      bits (scatter_gather), ``bit_length(k)`` times that for the vote counts (allgather); on one node
      (``k = 1``) the exact mean of the ``L`` votes: as allgather for ``L <= 4``, else step 4 shares their
      counts, ``bit_length(L)`` times ``(L-1)/L·d/8``.
    """
    comm = check_settings(method, inter_method)
    if isinstance(topology, tuple):
        k, lws = topology
        n = k * lws
    else:
        n, lws, k = topology.world_size, topology.local_world_size, topology.num_nodes
    plan = _plan_for(comm.method, lws, k)
    align = plan.alignment(n, lws, k, comm.inter_method)
    intra, inter = plan.sent(-(-numel // align) * align, n, lws, k, comm.inter_method)
    fp32 = fp32_allreduce_bytes(numel, n)
    return {"intra_node_bytes": intra, "inter_node_bytes": inter, "fp32_allreduce_bytes": fp32}


def check_agreement(
    numel: int,
    *,
    topology: Topology | None = None,
    method: str | CommSettings = DEFAULT_METHOD,
    inter_method: str = DEFAULT_INTER_METHOD,
    chunk_numel: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> None:
    """Check now, with every rank of ``topology``, that all will call :func:`onebit_all_reduce` with ``numel``
    elements of ``dtype`` and the same settings; every rank raises the same ``ValueError`` otherwise.

    :func:`onebit_all_reduce` does this itself on the first call with new arguments; a caller that must not change
    any state before a failing check (``StepAllReduce``) calls it first. Collective on a new signature (one
    all-gather of 7 int64 on ``device``); free afterwards (a cache lookup).
    """
    comm = check_settings(method, inter_method, chunk_numel)
    topo = _default_topology() if topology is None else topology
    if not isinstance(topo, Topology):
        raise TypeError(f"topology must be a birder_hf.Topology, got {type(topo).__name__}")
    plan, _, _, chunked = _layout(topo, numel, comm)
    check_device(topo.world_group, torch.device(device))
    signature = signature_of(topo, numel, plan.name, comm.inter_method, chunked, dtype)
    if not needs_check(topo, signature):
        return

    def start(wire):
        check_signature(topo, signature, torch.device(device))
        return None, DONE

    launch_in_order(topo, Job(Wire(topo, None), start, lambda wire, recv: None), async_op=False)


def _default_topology() -> Topology:
    return Topology.flat(dedicated=False)


def _as_keys(keys, numel: int) -> BitKeys:
    if isinstance(keys, BitKeys):
        if keys.numel != numel:
            raise ValueError(f"keys (BitKeys) describe {keys.numel} elements but u has {numel}")
        return keys
    if keys is None:
        # drawn per rank; every draw other ranks depend on is made on one rank and shared as bits
        keys = int(torch.randint(0, 1 << 62, (1,), dtype=torch.int64))
    if isinstance(keys, bool) or not isinstance(keys, numbers.Integral):
        raise TypeError(f"keys must be a quantize.BitKeys, an int seed or None, got {type(keys).__name__}")
    return BitKeys.single(int(keys), 0, numel)


def _quantize_own(flat: torch.Tensor, topo: Topology, keys: BitKeys) -> torch.Tensor:
    # this rank's votes, packed: the first draw of every method, as one of an antithetic pair of ranks
    who, reflect = antithetic(topo.rank)
    return keys.quantize_pack(flat, 0, STAGE_WORKER, who, reflect=reflect)


def own_votes(u: torch.Tensor, *, topology: Topology, keys: BitKeys) -> torch.Tensor:
    """The ±1 votes this rank casts for ``u`` in :func:`onebit_all_reduce` with the same ``topology`` and ``keys``
    (the same bits, drawn again: a function of the keys), flat, in ``u``'s dtype. For a caller that keeps its own
    rounding error (error feedback)."""
    flat = u.detach().reshape(-1)
    bits = unpack_bits(_quantize_own(flat, topology, keys), flat.numel())
    return bits.to(flat.dtype).mul_(2).sub_(1)


def onebit_all_reduce(
    u: torch.Tensor,
    *,
    topology: Topology | None = None,
    method: str | CommSettings = DEFAULT_METHOD,
    inter_method: str = DEFAULT_INTER_METHOD,
    keys: BitKeys | int | None = None,
    async_op: bool = False,
    chunk_numel: int | None = None,
    stats: CommStats | None = None,
    out: torch.Tensor | None = None,
):
    """Binary-randomize each rank's ``u`` to 1 bit and all-reduce the bits to their mean.

    .. math::
        q_r = Q(u_r), \\qquad d = \\mathrm{OneBitAllReduce}(q_1..q_n), \\qquad E[d] = \\frac{1}{n} \\sum_r u_r

    Args:
        u (`torch.Tensor`): this rank's values in ``[-1, 1]``, any shape, fp16/bf16/fp32/fp64. Values outside are
            clamped by the quantizer (``u >= 1`` and ``+inf`` vote +1, ``u <= -1`` -1, NaN -1), not refused: a check
            would cost a pass and a host sync per call, and the DDP hook sends a non-finite gradient's ``u`` too.
        topology (`Topology`, *optional*): defaults to the default group itself
            (``Topology.flat(dedicated=False)``: nothing is built per call). Async calls that may overlap
            must share one ``Topology``: calls on it run in call order; a dedicated one (any constructor's
            default) also keeps them apart from other collectives, such as DDP's own.
        method (`str`, *optional*, defaults to `"hierarchical"`): ``"allgather"`` (``d`` = exact mean of the
            n votes, multiples of ``1/n``), ``"scatter_gather"`` (``d`` in ``{-1, +1}``) or
            ``"hierarchical"`` (intra-node exact vote exchange, 1 bit across nodes); or a :class:`CommSettings`,
            all three settings already checked (then leave ``inter_method`` and ``chunk_numel`` unset).
        inter_method (`str`, *optional*, defaults to `"allgather"`): hierarchical only: the inter-node
            exchange; ``"allgather"`` gives ``d`` = exact mean of the k node bits, ``"scatter_gather"``
            ``d`` in ``{-1, +1}`` (less inter-node traffic when k > 2).
        keys (`BitKeys`, `int` or `None`): the keys of every draw (per-parameter segments keep the
            bits independent of bucket layout); an int is ``BitKeys.single(seed, 0, u.numel())``; ``None``
            draws a seed from torch's default generator.
        async_op (`bool`): return a ``torch.futures.Future`` whose value is ``d`` (usable from a DDP
            communication hook) instead of ``d``.
        chunk_numel (`int`, *optional*): elements per round (>= 1), rounded down to a multiple of ``8·n``
            (``8`` for allgather); bounds every receive buffer by about ``n · chunk_numel / 8`` bytes
            (higher => fewer, larger collectives). The result does not depend on it.
        stats (`CommStats`, *optional*): accumulates the bytes this rank sends.
        out (`torch.Tensor`, *optional*): a contiguous tensor with ``u``'s dtype, device and number of elements
            to write ``d`` into (and return), instead of a new one; it may be ``u`` itself (``u`` is read only
            before this call returns). Saves a page-faulting allocation per call on CPU.

    Returns:
        `torch.Tensor` (or a Future of it): ``d``, same shape and dtype as ``u``, bitwise identical on
        every rank.

    Raises:
        ValueError: an invalid setting (before any communication); or, on every rank, ranks that passed different
            arguments (``u``'s numel or dtype, the settings, the layout): checked on the first call with new arguments
            (:func:`check_agreement`), in call order on every rank.

    Example::

        >>> d = onebit_all_reduce(u, topology=Topology.from_layout(2, 2), method="hierarchical", keys=7)
    """
    comm = check_settings(method, inter_method, chunk_numel)
    if not isinstance(u, torch.Tensor) or not u.is_floating_point():
        raise TypeError(f"u must be a floating-point tensor (fp16/bf16/fp32/fp64), got {getattr(u, 'dtype', u)}")
    topo = _default_topology() if topology is None else topology
    if not isinstance(topo, Topology):
        raise TypeError(f"topology must be a birder_hf.Topology, got {type(topo).__name__}")
    topo.check_open()
    check_device(topo.world_group, u.device)
    flat, shape = u.detach().reshape(-1), u.shape
    numel, n = flat.numel(), topo.world_size
    keys = _as_keys(keys, numel)
    if out is None:
        out = torch.empty(shape, dtype=u.dtype, device=u.device)
    elif out.dtype != u.dtype or out.device != u.device or out.numel() != numel or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous tensor like u ({numel} elements of {u.dtype} on {u.device}); got "
            f"{out.numel()} elements of {out.dtype} on {out.device}{'' if out.is_contiguous() else ', non-contiguous'}"
        )
    result, out = out, out.detach().view(-1)
    plan_class, padded, step, chunked = _layout(topo, numel, comm)
    # the first call with these arguments checks that every rank passed the same (then a cache lookup)
    signature = signature_of(topo, numel, plan_class.name, comm.inter_method, chunked, u.dtype)
    check = needs_check(topo, signature)
    if stats is not None:
        stats.calls += 1
        stats.fp32_allreduce_bytes += fp32_allreduce_bytes(numel, n)
    if not padded and not check:  # nothing to exchange, nothing to check
        if not async_op:
            return result
        fut = torch.futures.Future(devices=[out.device] if out.device.type == "cuda" else None)
        fut.set_result(result)
        return fut

    # quantize my votes once (so u may change after an async return), as one of an antithetic pair of ranks;
    # padding votes -1 (bit 0)
    if numel:
        packed = _quantize_own(flat, topo, keys)
    else:
        packed = flat.new_empty(0, dtype=torch.uint8)
    if packed.numel() * 8 != padded:
        packed = torch.cat([packed, packed.new_zeros(padded // 8 - packed.numel())])
    chunks = [(c0, min(c0 + step, padded)) for c0 in range(0, padded, step)] if padded else []
    plan = plan_class(topo, comm.inter_method, keys, packed, out)

    def start(wire):
        if check:
            check_signature(topo, signature, u.device)
        if not chunks:
            return None, DONE
        return plan.start(wire, *chunks[0])

    def finish(wire, recv):
        for i, (c0, c1) in enumerate(chunks):
            if i:
                recv, work = plan.start(wire, c0, c1)
                work.wait()
            plan.finish(wire, c0, c1, recv)
        return result

    return launch_in_order(topo, Job(Wire(topo, stats), start, finish), async_op=async_op)
