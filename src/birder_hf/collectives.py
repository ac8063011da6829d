"""The 1-bit all-reduce of Birder: flat (``allgather``, ``scatter_gather``) and Hierarchical-1-bit-All-Reduce.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB
Official code: https://openi.pcl.ac.cn/c2net_optim/Birder
Deviations from the paper (reconstructed: the paper's code was not available to us):
    - every random draw is counter-based (``quantize.BitKeys``: seed, step, parameter, element index,
      stage, worker or node), so bits do not depend on bucket layout, chunking or shard ownership;
    - ``hierarchical`` step 1 exchanges the workers' votes inside a node as packed bits with an
      all-to-all (1 bit per element) instead of the int8 reduce-scatter of the design table: 8x fewer
      intra-node bytes, exact all the same, and async-capable on gloo (which has no async
      reduce-scatter);
    - with ``inter_method="allgather"`` the exact mean of the k node bits is kept (no re-quantization):
      step 4 shares it inside the node as the vote counts' binary digits, ``bit_length(k)`` bits per
      element (k = 1: 1 bit, k = 2, 3: 2 bits, k = 4..7: 3 bits);
    - received votes are never unpacked: fused kernels (``quantize.votes_mean_``, ``digits_mean_``,
      ``requantize_pack``) count them straight from the packed bytes and write the mean, or its re-quantized
      bits, in one pass; step 4's vote counts are made bit-sliced (a ripple-carry adder over the bytes).

Each method returns ``d``, identical bit for bit on every rank, with ``E[d] = mean_r u_r`` (up to the
``2^-23`` codec bias): every draw that other ranks depend on is made on exactly one rank and then
shared as bits.
"""

from __future__ import annotations

import math
import numbers
import threading
import weakref
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from .quantize import (
    STAGE_INTER_SHARD,
    STAGE_NODE,
    STAGE_SHARD,
    STAGE_WORKER,
    BitKeys,
    digits_mean_,
    votes_mean_,
)
from .topology import Topology

__all__ = ["onebit_all_reduce", "CommStats", "expected_bytes", "METHODS", "INTER_METHODS"]

METHODS = ("allgather", "scatter_gather", "hierarchical")
INTER_METHODS = ("allgather", "scatter_gather")

# all_gather_single replaces the deprecated all_gather_into_tensor in torch >= 2.13.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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

    def as_dict(self, prefix: str = "comm/") -> dict[str, float]:
        out = {prefix + f.name: getattr(self, f.name) for f in fields(self)}
        out[prefix + "compression_ratio"] = self.compression_ratio
        return out


def _layout(topology) -> tuple[int, int, int]:
    if isinstance(topology, tuple):
        k, lws = topology
        return k * lws, lws, k
    return topology.world_size, topology.local_world_size, topology.num_nodes


def _alignment(method: str, n: int, lws: int, k: int, inter_method: str) -> int:
    # elements per chunk must split into whole bytes for every shard of every stage
    if method == "allgather":
        return 8
    if method == "scatter_gather":
        return 8 * n
    return 8 * lws * (k if inter_method == "scatter_gather" else 1)


def expected_bytes(method: str, numel: int, topology, *, inter_method: str = "allgather") -> dict[str, int]:
    """Bytes one rank sends for ``numel`` elements, per the design table, made exact for padding.

    ``topology`` is a :class:`Topology` or a ``(num_nodes, local_world_size)`` tuple. Returns
    ``intra_node_bytes``, ``inter_node_bytes`` and ``fp32_allreduce_bytes`` (same accounting as
    :class:`CommStats`; independent of ``chunk_numel``). With ``d = numel`` (padded), ``n`` ranks,
    ``k`` nodes of ``L``:

    - allgather: ``(n-1)·d/8`` (intra ``(L-1)·d/8``, inter ``(n-L)·d/8``);
    - scatter_gather: ``2(n-1)/n·d/8`` split the same way;
    - hierarchical: inter ``(k-1)·d/(8L)`` (``inter_method="allgather"``) or ``2(k-1)/k·d/(8L)``
      (``"scatter_gather"``); intra ``(L-1)/L·d/8`` (step 1) plus step 4: ``(L-1)/L·d/8`` for the ±1
      bits (scatter_gather), ``bit_length(k)`` times that for the vote counts (allgather).
    """
    _check_method(method, inter_method)
    n, lws, k = _layout(topology)
    align = _alignment(method, n, lws, k, inter_method)
    d = -(-numel // align) * align
    intra = inter = 0
    if method in ("allgather", "scatter_gather"):
        per_peer = d // 8 if method == "allgather" else 2 * d // (8 * n)
        intra, inter = (lws - 1) * per_peer, (n - lws) * per_peer
    else:
        shard = d // lws  # elements per node shard
        intra = (lws - 1) * shard // 8  # step 1: all-to-all of the votes
        if inter_method == "allgather":
            inter = (k - 1) * shard // 8
            step4 = k.bit_length() * shard // 8  # the vote counts' binary digits
        else:
            inter = 2 * (k - 1) * (shard // k) // 8
            step4 = shard // 8
        intra += (lws - 1) * step4
    fp32 = round(2 * (n - 1) * 4 * numel / n)
    return {"intra_node_bytes": intra, "inter_node_bytes": inter, "fp32_allreduce_bytes": fp32}


def _check_method(method: str, inter_method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")
    if inter_method not in INTER_METHODS:
        raise ValueError(f"unknown inter_method {inter_method!r}; valid: {', '.join(INTER_METHODS)}")


def _check_device(group, device: torch.device) -> None:
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
        raise ValueError(
            f"u is on {device} but the process group's backend is {backend!r}; move u to a device the backend "
            "handles (nccl: cuda, gloo: cpu), or initialize with backend='cpu:gloo,cuda:nccl'."
        )


class _Done:
    """The completed 'work' of a collective on a group of one rank."""

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


class _Wire:
    """Collectives on the topology's groups, with byte accounting."""

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
            s.intra_node_bytes += (lws - 1) * per_peer
            s.inter_node_bytes += (size - lws) * per_peer
        elif scope == "intra":
            s.intra_node_bytes += (size - 1) * per_peer
        else:
            s.inter_node_bytes += (size - 1) * per_peer

    def all_gather(self, inp: torch.Tensor, scope: str):
        group, size = self._scope(scope)
        if size == 1:
            return inp, _Done()
        out = torch.empty(size * inp.numel(), dtype=inp.dtype, device=inp.device)
        self._count(scope, size, inp.numel() * inp.element_size())
        return out, _all_gather(out, inp, group=group, async_op=True)

    def all_to_all(self, inp: torch.Tensor, scope: str):
        group, size = self._scope(scope)
        if size == 1:
            return inp, _Done()
        out = torch.empty_like(inp)
        self._count(scope, size, inp.numel() * inp.element_size() // size)
        return out, dist.all_to_all_single(out, inp, group=group, async_op=True)

    def sync(self, kind: str, inp: torch.Tensor, scope: str) -> torch.Tensor:
        out, work = getattr(self, kind)(inp, scope)
        work.wait()
        return out


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


class _Pipeline:
    """One call's plan: stage 1 (``start``) can run async; the rest (``finish``) runs after it."""

    def __init__(self, topo, method, inter_method, keys, packed, out, wire):
        self.topo, self.method, self.inter_method = topo, method, inter_method
        self.keys, self.packed, self.out, self.wire = keys, packed, out, wire

    def start(self, c0: int, c1: int):
        send = self.packed[c0 // 8 : c1 // 8]
        if self.method == "allgather":
            return self.wire.all_gather(send, "world")
        return self.wire.all_to_all(send, "world" if self.method == "scatter_gather" else "intra")

    def finish(self, c0: int, c1: int, recv: torch.Tensor) -> None:
        getattr(self, "_finish_" + self.method)(c0, c1, recv)

    # -------------------------------------------------------------------------------------- outputs
    def _write(self, c0: int, c1: int, rows: torch.Tensor) -> None:
        # the exact mean of the votes in rows (m, P) for elements [c0, c1) (m = 1: the +-1 bits themselves)
        votes_mean_(self.out[c0 : min(c1, self.out.numel())], rows)

    def _requantize(self, rows: torch.Tensor, start: int, stage: int, who: int) -> torch.Tensor:
        # mean of the votes in ``rows`` re-quantized to 1 bit; one draw, made on this rank only
        return self.keys.requantize_pack(rows, start, stage, who)

    # -------------------------------------------------------------------------------------- methods
    def _finish_allgather(self, c0, c1, recv):
        self._write(c0, c1, recv.view(self.topo.world_size, -1))

    def _finish_scatter_gather(self, c0, c1, recv):
        n, r = self.topo.world_size, self.topo.rank
        shard = (c1 - c0) // n
        # average the n votes of my shard, re-quantize it, share the bits
        bits = self._requantize(recv.view(n, -1), c0 + r * shard, STAGE_SHARD, 0) if n > 1 else recv
        self._write(c0, c1, self.wire.sync("all_gather", bits, "world").view(1, -1))

    def _finish_hierarchical(self, c0, c1, recv):
        t = self.topo
        lws, k, j, g = t.local_world_size, t.num_nodes, t.local_rank, t.node_rank
        shard = (c1 - c0) // lws
        # 1-2) node mean of my node shard from the L votes, re-quantized to 1 bit by this rank only
        # (with L == 1 the vote is already +-1 and re-quantizing it would return the same bit)
        node_bits = recv if lws == 1 else self._requantize(recv.view(lws, -1), c0 + j * shard, STAGE_NODE, g)
        if self.inter_method == "allgather":
            # 3) every rank of my column gets all k node bits of the shard: their exact mean, no draw
            gathered = self.wire.sync("all_gather", node_bits, "inter").view(k, -1)
            # 4) share that mean inside the node as its vote counts: bit_length(k) packed bits per element
            planes = _count_planes(gathered)
            full = self.wire.sync("all_gather", planes.reshape(-1), "intra").view(lws, planes.shape[0], -1)
            for i, block in enumerate(full):  # local rank i's shard: elements c0 + i·shard ...
                lo = min(c0 + i * shard, self.out.numel())
                digits_mean_(self.out[lo : min(lo + shard, self.out.numel())], block, k)
        else:
            # 3) inter-node scatter-gather of the node bits: my sub-shard's k votes, re-quantized once
            sub = shard // k
            mine = self.wire.sync("all_to_all", node_bits, "inter")
            if k > 1:
                mine = self._requantize(mine.view(k, -1), c0 + j * shard + g * sub, STAGE_INTER_SHARD, 0)
            shard_bits = self.wire.sync("all_gather", mine, "inter")
            # 4) intra-node all-gather of the +-1 shard results
            self._write(c0, c1, self.wire.sync("all_gather", shard_bits, "intra").view(1, -1))


# Calls on one Topology run their collectives in call order, on every rank: a pending async call's
# successor starts only when it has finished. (On gloo, callbacks run on the backend's threads; two
# pipelines interleaving their collectives in different orders on different ranks would mix them up.)
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


def _settled(fut: torch.futures.Future) -> None:
    fut.wait()  # propagate a failure to the next call in the queue


def _as_keys(generator, numel: int) -> BitKeys:
    if isinstance(generator, BitKeys):
        if generator.numel != numel:
            raise ValueError(f"generator (BitKeys) describes {generator.numel} elements but u has {numel}")
        return generator
    if generator is None:
        # drawn per rank; every draw other ranks depend on is made on one rank and shared as bits
        generator = int(torch.randint(0, 1 << 62, (1,), dtype=torch.int64))
    if isinstance(generator, bool) or not isinstance(generator, numbers.Integral):
        raise TypeError(f"generator must be a quantize.BitKeys, an int seed or None, got {type(generator).__name__}")
    return BitKeys.single(int(generator), 0, numel)


def onebit_all_reduce(
    u: torch.Tensor,
    *,
    topology: Topology | None = None,
    method: str = "allgather",
    inter_method: str = "allgather",
    generator: BitKeys | int | None = None,
    async_op: bool = False,
    chunk_numel: int | None = None,
    stats: CommStats | None = None,
    out: torch.Tensor | None = None,
):
    """Binary-randomize each rank's ``u`` to 1 bit and all-reduce the bits to their mean.

    .. math::
        q_r = Q(u_r), \\qquad d = \\mathrm{OneBitAllReduce}(q_1..q_n), \\qquad E[d] = \\frac{1}{n} \\sum_r u_r

    Args:
        u (`torch.Tensor`): this rank's values in ``[-1, 1]``, any shape, fp16/bf16/fp32/fp64.
        topology (`Topology`, *optional*): defaults to the default group itself
            (``Topology.flat(dedicated=False)``: nothing is built per call). Async calls that may overlap
            must share one ``Topology``: calls on it run in call order; a dedicated one (any constructor's
            default) also keeps them apart from other collectives, such as DDP's own.
        method (`str`, *optional*, defaults to `"allgather"`): ``"allgather"`` (``d`` = exact mean of the
            n votes, multiples of ``1/n``), ``"scatter_gather"`` (``d`` in ``{-1, +1}``) or
            ``"hierarchical"`` (intra-node exact vote exchange, 1 bit across nodes).
        inter_method (`str`, *optional*, defaults to `"allgather"`): hierarchical only: the inter-node
            exchange; ``"allgather"`` gives ``d`` = exact mean of the k node bits, ``"scatter_gather"``
            ``d`` in ``{-1, +1}`` (less inter-node traffic when k > 2).
        generator (`BitKeys`, `int` or `None`): the keys of every draw (per-parameter segments keep the
            bits independent of bucket layout); an int is ``BitKeys.single(seed, 0, u.numel())``; ``None``
            draws a seed from torch's default generator.
        async_op (`bool`): return a ``torch.futures.Future`` whose value is ``d`` (usable from a DDP
            communication hook) instead of ``d``.
        chunk_numel (`int`, *optional*): elements per round, rounded down to a multiple of ``8·n``
            (``8`` for allgather); bounds every receive buffer by about ``n · chunk_numel / 8`` bytes
            (higher => fewer, larger collectives). The result does not depend on it.
        stats (`CommStats`, *optional*): accumulates the bytes this rank sends.
        out (`torch.Tensor`, *optional*): a contiguous tensor with ``u``'s dtype, device and number of elements
            to write ``d`` into (and return), instead of a new one; it may be ``u`` itself (``u`` is read only
            before this call returns). Saves a page-faulting allocation per call on CPU.

    Returns:
        `torch.Tensor` (or a Future of it): ``d``, same shape and dtype as ``u``, bitwise identical on
        every rank.

    Example::

        >>> d = onebit_all_reduce(u, topology=Topology.from_layout(2, 2), method="hierarchical", generator=7)
    """
    _check_method(method, inter_method)
    if not isinstance(u, torch.Tensor) or not u.is_floating_point():
        raise TypeError(f"u must be a floating-point tensor (fp16/bf16/fp32/fp64), got {getattr(u, 'dtype', u)}")
    topo = Topology.flat(dedicated=False) if topology is None else topology
    if not isinstance(topo, Topology):
        raise TypeError(f"topology must be a birder_hf.Topology, got {type(topo).__name__}")
    _check_device(topo.world_group, u.device)
    flat, shape = u.detach().reshape(-1), u.shape
    numel, n = flat.numel(), topo.world_size
    keys = _as_keys(generator, numel)
    if out is None:
        out = torch.empty(shape, dtype=u.dtype, device=u.device)
    elif out.dtype != u.dtype or out.device != u.device or out.numel() != numel or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous tensor like u ({numel} elements of {u.dtype} on {u.device}); got "
            f"{out.numel()} elements of {out.dtype} on {out.device}{'' if out.is_contiguous() else ', non-contiguous'}"
        )
    result, out = out, out.detach().view(-1)
    if stats is not None:
        stats.calls += 1
        stats.fp32_allreduce_bytes += round(2 * (n - 1) * 4 * numel / n)

    # quantize my votes once (so u may change after an async return); padding votes -1 (bit 0)
    align = _alignment(method, n, topo.local_world_size, topo.num_nodes, inter_method)
    padded = -(-numel // align) * align
    packed = keys.quantize_pack(flat, 0, STAGE_WORKER, topo.rank) if numel else flat.new_empty(0, dtype=torch.uint8)
    if packed.numel() * 8 != padded:
        packed = torch.cat([packed, packed.new_zeros(padded // 8 - packed.numel())])
    step = padded if chunk_numel is None else max(align, int(chunk_numel) // align * align)
    chunks = [(c0, min(c0 + step, padded)) for c0 in range(0, padded, step)]
    pipe = _Pipeline(topo, method, inter_method, keys, packed, out, _Wire(topo, stats))

    def run(chunks_left, first=None, after=None):
        try:
            if after is not None:
                after.wait()  # re-raise a failed collective or predecessor
            if first is not None:
                pipe.finish(*chunks_left[0], first)
                chunks_left = chunks_left[1:]
            for c0, c1 in chunks_left:
                recv, work = pipe.start(c0, c1)
                work.wait()
                pipe.finish(c0, c1, recv)
        finally:
            # Drop the process groups here: a callback's closure dies on the backend's thread, and
            # if it held the last reference, the group's destructor would join that very thread.
            pipe.topo = pipe.wire = None
        return result

    queue = _queue(topo)
    if not async_op:
        with queue.lock:
            tail = queue.tail
        if tail is not None and not tail.done():
            tail.wait()
        return run(chunks)
    with queue.lock:
        tail = queue.tail
        if not chunks:
            fut = torch.futures.Future(devices=[out.device] if out.device.type == "cuda" else None)
            fut.set_result(result)
        elif tail is None or tail.done():
            recv, work = pipe.start(*chunks[0])
            fut = work.get_future().then(lambda f: run(chunks, first=recv, after=f))
        else:
            fut = tail.then(lambda f: run(chunks, after=f))
        queue.tail = fut.then(_settled)  # the queue keeps a marker, not d
    return fut
