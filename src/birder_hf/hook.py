"""The Birder DDP communication hook: the 1-bit all-reduce inside DDP's backward pass.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB

The hook owns the communication, the optimizer owns the state. For every bucket DDP hands over, the
hook updates ``m`` and ``b`` of the bucket's parameters (found through ``bucket.parameters()``, so
DDP's bucket rebuild after the first iteration cannot scramble them), computes ``u = m / b``, starts
``onebit_all_reduce`` asynchronously (overlapping the rest of backward) and returns a Future of the
direction ``d``, which DDP writes into ``.grad``. ``Birder.step()`` then applies
``x <- x - lr * (d + wd * x)``.

Non-finite gradients: the new ``m`` and ``b`` are written to second buffers and committed in
``optimizer.step()`` only after all ranks agreed (one tiny all-reduce of a flag per step) that every
gradient was finite; otherwise every rank skips the step and ``m``, ``b`` and the parameters stay as
they were. The price is a second copy of ``m`` and ``b`` (8 bytes per parameter). Our design, not
the paper's.

Usage::

    model = DDP(model)
    opt = Birder(model.parameters(), lr=1e-3)
    state = BirderHookState(opt, topology=Topology.from_env(), method="hierarchical")
    model.register_comm_hook(state, birder_hook)

Gradient accumulation: use ``model.no_sync()`` (or ``accelerator.accumulate``) for the micro-batches
before the last; the hook then sees the accumulated local gradient once per step.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import math
import warnings

import torch
import torch.distributed as dist

from .collectives import METHODS, CommStats, onebit_all_reduce
from .optim import Birder, _single_tensor_encode
from .quantize import BitKeys
from .topology import Topology

__all__ = ["BirderHookState", "birder_hook"]


class BirderHookState:
    """State of :func:`birder_hook`: the optimizer, the topology and the communication settings.

    Args:
        optimizer (`Birder`): the optimizer whose parameters the DDP model holds. Its ``step()``
            switches to "apply d" mode; one hook state per optimizer.
        topology (`Topology`, *optional*): defaults to ``Topology.flat()`` (all ranks one node).
        method (`str`, *optional*, defaults to `"allgather"`): ``"allgather"``, ``"scatter_gather"``
            or ``"hierarchical"`` (see ``onebit_all_reduce``).
        inter_method (`str`, *optional*, defaults to `"allgather"`): the inter-node exchange of
            ``"hierarchical"``.
        chunk_numel (`int`, *optional*): bound on the elements per collective (receive buffers).
        check_finite (`bool`, *optional*, defaults to `True`): skip a step on every rank when any rank
            has a non-finite gradient (costs one tiny all-reduce and a host sync per step).
    """

    __slots__ = (
        # settings
        "optimizer",
        "topology",
        "method",
        "inter_method",
        "chunk_numel",
        "check_finite",
        # per-step buffers
        "_pending",
        "_scratch",
        "_flags",
        "_seen_params",
        # statistics
        "stats",
        "steps_communicated",
        "skipped_steps",
    )

    def __init__(
        self,
        optimizer: Birder,
        topology: Topology | None = None,
        method: str = "allgather",
        *,
        inter_method: str = "allgather",
        chunk_numel: int | None = None,
        check_finite: bool = True,
    ):
        if not isinstance(optimizer, Birder):
            raise TypeError(f"BirderHookState needs a birder_hf.Birder optimizer, got {type(optimizer).__name__}.")
        if optimizer._hook_state is not None:
            raise ValueError(
                "This Birder optimizer already has a hook state (the hook was registered before); "
                "register birder_hook once per model and optimizer."
            )
        if method not in METHODS:
            raise ValueError(f"Unknown method {method!r}; choose one of {sorted(METHODS)}.")
        if not all(g["quantize"] for g in optimizer.param_groups):
            raise ValueError("quantize=False is for one process only; the DDP hook always sends 1 bit.")
        if optimizer._topology is not None:
            raise ValueError("Birder was given a process_group/topology; with the DDP hook pass it to the hook state.")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("birder_hook needs torch.distributed to be initialized (init_process_group).")
        self.optimizer = optimizer
        self.topology = topology if topology is not None else Topology.flat()
        self.method, self.inter_method = method, inter_method
        self.chunk_numel, self.check_finite = chunk_numel, check_finite
        self._pending: dict[torch.Tensor, tuple] = {}  # param -> (state, new m, new b, new max b)
        self._scratch: dict[torch.Tensor, tuple] = {}  # param -> the buffers the next step writes into
        self._flags: list[torch.Tensor] = []
        self._seen_params: set[torch.Tensor] = set()
        self.stats = CommStats()
        self.steps_communicated = 0
        self.skipped_steps = 0
        optimizer._hook_state = self  # explicit: step() now applies the d the hook produced

    def __getstate__(self):
        raise TypeError(
            "BirderHookState holds process groups and is not saved; save the optimizer with "
            "birder_hf.checkpoint instead and create a new hook state after loading."
        )

    def _buffers(self, p: torch.Tensor, state: dict, amsgrad: bool):
        bufs = self._scratch.get(p)
        if bufs is None or bufs[0].shape != state["exp_avg"].shape:
            m = torch.empty_like(state["exp_avg"])
            bufs = (m, torch.empty_like(m), torch.empty_like(m) if amsgrad else None)
            self._scratch[p] = bufs
        return bufs

    def _finish_step(self) -> bool:
        """Called by ``Birder.step()``: agree on finiteness, then commit or drop the new m and b."""
        pending, flags = self._pending, self._flags
        self._pending, self._flags = {}, []
        ok = True
        if self.check_finite and pending:
            dev = next(iter(pending.values()))[1].device
            bad = torch.stack(flags).any().to(torch.float32).reshape(1) if flags else torch.zeros(1, device=dev)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.topology.world_group)
            ok = bad.item() == 0.0
        if not ok:
            self.skipped_steps += 1
            self._seen_params.clear()
            warnings.warn(
                "Birder: a rank had a non-finite gradient; every rank skipped this step.", RuntimeWarning, stacklevel=3
            )
            return False
        for p, (state, m, b, bmax) in pending.items():
            if p.grad is None:  # unused everywhere: DDP left .grad unset; skip as the no-hook path does
                continue
            # swap: the committed buffers become next step's scratch
            self._scratch[p] = (state["exp_avg"], state["exp_avg_abs"], state.get("max_exp_avg_abs"))
            state["exp_avg"], state["exp_avg_abs"] = m, b
            if bmax is not None:
                state["max_exp_avg_abs"] = bmax
            state["step"] += 1
        if pending:
            self.steps_communicated += 1
        return True


def birder_hook(state: BirderHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: 1-bit all-reduce of Birder's ``u`` for one bucket (see module docstring).

    Returns a Future whose value is the direction ``d`` for the bucket (bucket dtype), identical on
    every rank, with ``E[d]`` the mean over ranks of their ``u``.
    """
    opt = state.optimizer
    buffer = bucket.buffer()
    params = bucket.parameters()
    u_dtype = torch.float64 if buffer.dtype == torch.float64 else torch.float32
    u_flat = torch.empty(buffer.numel(), dtype=u_dtype, device=buffer.device)
    if state.check_finite:
        # min and max propagate NaN and hold +-inf: one reduction pass, 12x cheaper than isfinite(buffer).all()
        state._flags.append(~torch.isfinite(torch.stack(torch.aminmax(buffer))).all())

    by_group: dict[int, list] = {}
    ids, sizes, steps, offset = [], [], [], 0
    strided = []  # (offset, shape, strides) of the gradients the bucket holds in another memory order
    for p in params:
        group = opt.group_of(p)
        if group is None:
            raise RuntimeError(
                f"A DDP parameter of shape {tuple(p.shape)} is not in the Birder optimizer; every parameter "
                "that gets gradients must be optimized by the Birder instance the hook state was built with."
            )
        if p in state._pending:
            raise RuntimeError(
                "birder_hook saw the same parameter twice before optimizer.step(): for gradient accumulation "
                "wrap the micro-batches before the last in model.no_sync() (or use accelerator.accumulate)."
            )
        st = opt._init_state(p, group["amsgrad"])
        n = p.numel()
        g = _grad_view(buffer, p, offset)
        if not g.is_contiguous():
            strided.append((offset, g.shape, g.stride()))
        by_group.setdefault(id(group), [group, [], [], [], []])
        entry = by_group[id(group)]
        entry[1].append((p, st))
        entry[2].append(g)
        entry[3].append(u_flat[offset : offset + n].view(p.shape))
        ids.append(opt.param_index(p))
        sizes.append(n)
        steps.append(int(st["step"]) + 1)
        offset += n

    for group, pst, gs, us, _ in by_group.values():
        amsgrad = group["amsgrad"]
        bufs = [state._buffers(p, st, amsgrad) for p, st in pst]
        out = ([b[0] for b in bufs], [b[1] for b in bufs], [b[2] for b in bufs])
        _single_tensor_encode(
            gs,
            [st["exp_avg"] for _, st in pst],
            [st["exp_avg_abs"] for _, st in pst],
            [st["max_exp_avg_abs"] for _, st in pst] if amsgrad else None,
            beta=group["beta"],
            maximize=group["maximize"],
            out=out,
            u_out=us,
        )
        for (p, st), b in zip(pst, bufs):
            state._pending[p] = (st, *b)
            state._seen_params.add(p)

    keys = BitKeys(opt.seed, steps, ids, sizes)
    fut = onebit_all_reduce(
        u_flat,
        topology=state.topology,
        method=state.method,
        inter_method=state.inter_method,
        generator=keys,
        async_op=True,
        chunk_numel=state.chunk_numel,
        stats=state.stats,
    )
    if buffer.dtype == u_dtype and not strided:
        return fut
    return fut.then(lambda f: _to_bucket_layout(f.value().to(buffer.dtype), strided))


def _is_dense(t: torch.Tensor) -> bool:
    # its elements fill numel() consecutive slots in some order of the dimensions (no gaps, no overlap)
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _grad_view(buffer: torch.Tensor, p: torch.Tensor, offset: int) -> torch.Tensor:
    """``p``'s gradient in the bucket as DDP lays it out: in ``p``'s own memory order when ``p`` is dense (NHWC for
    a channels_last conv weight), C-contiguous otherwise (torch's ``Reducer::initialize_bucket_views``).

    ``GradBucket.gradients()`` views every segment C-contiguously, which scrambles a channels_last gradient.
    """
    if _is_dense(p):
        return buffer.as_strided(p.shape, p.stride(), buffer.storage_offset() + offset)
    return buffer[offset : offset + p.numel()].view(p.shape)


def _to_bucket_layout(d: torch.Tensor, strided: list) -> torch.Tensor:
    """Put each listed parameter's segment of ``d`` (built in logical order, so that the bits' counters follow
    the logical index as in ``Birder.step()``) into the bucket's memory order, in which DDP reads it back."""
    for offset, shape, stride in strided:
        segment = d[offset : offset + math.prod(shape)].clone()
        d.as_strided(shape, stride, d.storage_offset() + offset).copy_(segment.view(shape))
    return d
