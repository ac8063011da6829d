"""The Birder DDP communication hook: the 1-bit all-reduce inside DDP's backward pass.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB

For every bucket DDP hands over, the hook encodes ``u = m / b`` of the bucket's parameters (found through
``bucket.parameters()``, so DDP's bucket rebuild cannot scramble them), starts ``onebit_all_reduce`` asynchronously
and returns a Future of the direction ``d``, which DDP writes into ``.grad``; ``Birder.step()`` applies it.

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

or ``attach_ddp_hook(model, opt)``, which also picks 1-bit Adam's hook for a ``OneBitAdam``.

Gradient accumulation: use ``model.no_sync()`` (or ``accelerator.accumulate``) for the micro-batches
before the last; the hook then sees the accumulated local gradient once per step.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import math

import torch
import torch.distributed as dist

from .base import OneBitOptimizer, Update, explain, unwrap_optimizer
from .collectives import onebit_all_reduce
from .communicators import DDPBuckets, HookState, Staged, agree_setup, is_dense, setup_group
from .lifecycle import then
from .optim import Birder, EncodeOut, StateBuffers
from .settings import DEFAULT_INTER_METHOD, DEFAULT_METHOD, CommSettings, check_settings
from .topology import Topology

__all__ = ["BirderHookState", "BirderStagedState", "birder_hook", "attach_ddp_hook", "unwrap_ddp"]


class BirderStagedState(HookState):
    """What Birder's two hook states share: :class:`BirderHookState` (DDP, a bucket at a time) and
    ``birder_hf.fsdp.FSDPHookState`` (FSDP2, a unit's shard at a time). Internal slots: the buffers each parameter's
    next ``m``, ``b`` are staged in (``scratch``), each bucket's or unit's ``u`` (then ``d``) buffer (``u_buffers``),
    and the DDP hook's record of ``d`` as it handed it to DDP (``samples``). The functions below work on it:
    :func:`encode_and_stage`, :func:`start_exchange`, :func:`commit_staged` (what ``step()`` applies)."""

    optimizer_class = Birder
    skip_unused = True

    __slots__ = ("scratch", "u_buffers", "samples")

    def __init__(self, *args, **kwargs):
        self.scratch: dict[torch.Tensor, StateBuffers] = {}  # param -> the buffers its next step writes into
        self.u_buffers: dict[int, torch.Tensor] = {}  # bucket or unit index -> its u (then d) buffer
        # param -> (its bucket's samples of d, its index in them): the first element of its d, recorded as d was
        # handed to DDP (a later backward's replaces a skipped one's)
        self.samples: dict[torch.Tensor, tuple[torch.Tensor, int]] = {}
        super().__init__(*args, **kwargs)

    def buffer_bytes(self) -> int:
        """Bytes of the buffers kept between steps: the staged ``m``, ``b`` (and max ``b``, the error) of every
        parameter, and the kept ``u`` buffers (:func:`u_buffer`)."""
        kept = [t for bufs in self.scratch.values() for t in bufs if t is not None] + list(self.u_buffers.values())
        return sum(t.nbytes for t in kept)

    def finish_step(self) -> list[Update] | None:
        """Wait for the exchanges, agree the step is finite, commit the staged ``m``, ``b`` and hand ``d`` to
        ``step()``."""
        return commit_staged(self, self.take_staged())


def u_buffer(state: BirderStagedState, index: int, numel: int, dtype: torch.dtype, device, *, keep: bool):
    """The buffer bucket or unit ``index`` encodes ``u`` into (and receives ``d`` in). With ``keep``, one per index,
    reused every step; otherwise a new one. The FSDP hook keeps them (``step()`` reads ``d`` from them); the DDP hook
    on CPU only (``d`` is read by the next step, and a new buffer would page-fault on every step; CUDA's caching
    allocator reuses memory anyway)."""
    if not keep:
        return torch.empty(numel, dtype=dtype, device=device)
    buf = state.u_buffers.get(index)
    if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
        buf = state.u_buffers[index] = torch.empty(numel, dtype=dtype, device=device)
    return buf


def _scratch_for(state: BirderStagedState, p: torch.Tensor, opt_state: dict, group: dict) -> StateBuffers:
    bufs = state.scratch.get(p)
    amsgrad, feedback = group["amsgrad"], group["error_feedback"]
    if (
        bufs is None
        or bufs.exp_avg.shape != opt_state["exp_avg"].shape
        or (bufs.max_exp_avg_abs is None) == amsgrad
        or (bufs.error is None) == feedback
    ):
        m = torch.empty_like(opt_state["exp_avg"])
        extra = [torch.empty_like(m) if on else None for on in (amsgrad, feedback)]
        bufs = StateBuffers(m, torch.empty_like(m), *extra)
        state.scratch[p] = bufs
    return bufs


def encode_and_stage(state: BirderStagedState, items: list[tuple], u_flat: torch.Tensor, *, keep: bool = False):
    """Encode ``items`` (parameter, its gradient, its group) into consecutive views of ``u_flat`` (logical order, as
    in ``Birder.step()``) and stage their new ``m``, ``b`` for :func:`commit_staged` (with ``keep``: their views of
    ``u_flat`` too, the directions ``step()`` applies). Returns the parameters and the keys of their bits."""
    opt = state.optimizer
    params, steps, at = [], [], 0
    by_group: dict[int, tuple[dict, list, list, list]] = {}
    for p, g, group in items:
        steps.append(int(opt.init_state(p, group)["step"]) + 1)
        ps, gs, vs = by_group.setdefault(id(group), (group, [], [], []))[1:]
        ps.append(p)
        gs.append(g)
        vs.append(u_flat[at : at + g.numel()].view(g.shape))
        params.append(p)
        at += g.numel()
    for group, ps, gs, vs in by_group.values():
        bufs = [_scratch_for(state, p, opt.state[p], group) for p in ps]
        maxes = [b.max_exp_avg_abs for b in bufs] if group["amsgrad"] else None
        errors = [b.error for b in bufs] if group["error_feedback"] else None
        staged = EncodeOut([b.exp_avg for b in bufs], [b.exp_avg_abs for b in bufs], maxes, vs, errors)
        opt.encode(group, ps, gs, out=staged, grad_scale=state.loss_scale())
        for p, b, u in zip(ps, bufs, vs):
            state.stage(p, group, b, u if keep else None)
    return params, opt.bit_keys(params, steps)


def start_exchange(
    state: BirderStagedState, u: torch.Tensor, keys, out: torch.Tensor | None = None
) -> torch.futures.Future:
    """Start the 1-bit all-reduce of ``u`` (flat) with the state's settings; ``d`` overwrites ``out`` (default
    ``u``)."""
    topology, comm, stats = state.topology, state.comm_settings, state.step_stats
    out = u if out is None else out
    return onebit_all_reduce(u, topology=topology, method=comm, keys=keys, async_op=True, stats=stats, out=out)


def _sample_directions(state: BirderStagedState, fut: torch.futures.Future, items: list) -> torch.futures.Future:
    """``fut`` (a bucket's ``d``, in the bucket's layout), recording the first element of each parameter's ``d`` when
    it is ready, before DDP copies it into ``.grad``: :func:`commit_staged` checks ``.grad`` still holds it."""
    kept = [b for b in items if b.param.numel() > 0]
    if not kept:
        return fut
    params, offsets = [b.param for b in kept], [b.offset for b in kept]

    def sample(f):
        d = f.value()
        values = d[torch.tensor(offsets, device=d.device)]
        state.samples.update((p, (values, i)) for i, p in enumerate(params))
        return d

    return then(fut, sample)


def _check_directions(state: BirderStagedState, pending: dict[torch.Tensor, Staged]) -> None:
    # d in .grad must be what the hook produced: anything that rewrote .grad since (clip_grad_norm_ in an fp32
    # loop, accelerator.clip_grad_norm_, an unscale, a hand edit) would scale a step that lr alone bounds
    samples, state.samples = state.samples, {}
    recorded, now = [], []
    for p, (values, i) in samples.items():
        if p in pending and pending[p].direction is None and p.grad is not None:
            recorded.append(values[i])
            now.append(p.grad[(0,) * p.grad.dim()])
    if recorded and not torch.equal(torch.stack(recorded), torch.stack(now).to(recorded[0].dtype)):
        what = f"The direction d that {state.hook_name} wrote into .grad was changed before step() (a "
        what += "clip_grad_norm_, an unscale_ or an edit of .grad after backward)"
        fix = "do not clip or rewrite .grad with the 1-bit hook (every step is bounded by lr already). Nothing "
        fix += "was applied"
        raise RuntimeError(explain(what, fix))


def commit_staged(state: BirderStagedState, pending: dict[torch.Tensor, Staged] | None) -> list[Update] | None:
    """Commit the staged ``m``, ``b`` (``pending``: the state's ``take_staged()``) and return what ``step()``
    applies: each parameter's staged direction, else ``d`` in ``.grad`` (then set to ``None``: it is no gradient).
    ``None``: every rank skips the step."""
    if pending is None:
        state.samples = {}
        return None
    _check_directions(state, pending)
    opt, updates = state.optimizer, []
    for group in opt.param_groups:
        # not those no rank computed a gradient for (a gradient of None, or found unused by take_staged)
        params = [p for p in group["params"] if p.grad is not None and p in pending]
        for p in params:  # the committed buffers become the next step's scratch
            state.scratch[p] = opt.commit_state(p, pending[p].record)
        if params:
            ds = [p.grad if pending[p].direction is None else pending[p].direction for p in params]
            updates.append(Update(group, params, ds))
            for p in params:
                if pending[p].direction is None:
                    # d is handed over: .grad holds no gradient, and a loop that forgot zero_grad() would add it
                    # into the next backward's gradients (m off by d / (1 - beta)); torch's set_to_none
                    p.grad = None
    return updates


class BirderHookState(BirderStagedState):
    """State of :func:`birder_hook`: the optimizer, the topology and the communication settings.

    Args:
        optimizer (`Birder`): the optimizer whose parameters the DDP model holds; it becomes the
            optimizer's communicator (one hook state per optimizer).
        topology (`Topology`, *optional*): defaults to ``Topology.flat()`` (all ranks one node).
        method (`str`, *optional*, defaults to `"hierarchical"`): ``"allgather"``, ``"scatter_gather"``
            or ``"hierarchical"`` (see ``onebit_all_reduce``; on one node, hierarchical gives the exact
            vote mean).
        inter_method (`str`, *optional*, defaults to `"allgather"`): the inter-node exchange of
            ``"hierarchical"``.
        chunk_numel (`int`, *optional*): bound on the elements per collective (receive buffers).
        check_finite (`bool`, *optional*, defaults to `True`): skip a step on every rank when any rank
            has a non-finite gradient (one tiny all-reduce and a host sync per step). The same all-reduce finds the
            parameters no rank computed a gradient for: they are not stepped, as with a gradient of None (with
            ``check_finite=False``, only where ``.grad`` is None: use ``zero_grad(set_to_none=True)``).
        agree_group (`ProcessGroup`, *optional*): the ranks that agree a step is finite; defaults to the
            topology's.
        grad_scaler (`torch.amp.GradScaler`, *optional*): the scaler that scales the loss (fp16): the hook encodes
            ``g / S`` with the scale ``S`` each backward used (exact: a power of two), so ``m`` and ``b`` are those of
            the unscaled run (``docs/SETUPS.md``, fp16).

    Slots: the user's settings (``optimizer``, ``topology``, ``comm_settings``, ``check_finite``, ``grad_scaler``),
    the internal state (``buckets``, :class:`birder_hf.communicators.DDPBuckets`: where each gradient lies in DDP's
    buckets; the staged buffers of :class:`BirderStagedState`; the step's agreement) and the statistics (``stats``,
    ``last_step_stats``, ``step_stats``, ``steps_communicated``, ``skipped_steps``).
    """

    hook_name = "birder_hook"

    __slots__ = ("buckets",)

    def __init__(
        self,
        optimizer: Birder,
        topology: Topology | None = None,
        method: str | CommSettings = DEFAULT_METHOD,
        *,
        inter_method: str = DEFAULT_INTER_METHOD,
        chunk_numel: int | None = None,
        check_finite: bool = True,
        agree_group=None,
        grad_scaler=None,
    ):
        comm, error = None, None
        try:  # built once, here; a bad value on one rank is raised on every rank by the set-up agreement
            comm = check_settings(method, inter_method, chunk_numel)
        except Exception as exc:
            error = exc
        kwargs = {"check_finite": check_finite, "agree_group": agree_group, "grad_scaler": grad_scaler}
        super().__init__(optimizer, topology, comm_settings=comm, setup_error=error, **kwargs)
        self.buckets = DDPBuckets(self)

    @property
    def description(self) -> str:
        return f"1-bit {self.comm_settings.method} hook"


def birder_hook(state: BirderHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: 1-bit all-reduce of Birder's ``u`` for one bucket (see module docstring).

    Encodes the bucket's parameters (their new ``m``, ``b`` staged until ``optimizer.step()``), starts the
    all-reduce and returns a Future whose value is the direction ``d`` for the bucket (bucket dtype), identical on
    every rank, with ``E[d]`` the mean over ranks of their ``u``.
    """
    items = state.buckets.begin(bucket)  # the bucket's parameters, gradients and groups, checked
    try:
        state.optimizer.check_state_matches([b.param for b in items])
        buffer = bucket.buffer()
        u_dtype = torch.float64 if buffer.dtype == torch.float64 else torch.float32
        keep = buffer.device.type == "cpu"
        u_flat = u_buffer(state, bucket.index(), buffer.numel(), u_dtype, buffer.device, keep=keep)
        params, keys = encode_and_stage(state, [(b.param, b.grad, b.group) for b in items], u_flat)
        strided, offset = [], 0  # (offset, shape, strides) of the gradients the bucket holds in another memory order
        for p in params:
            if is_dense(p) and not p.is_contiguous():  # DDP reads a new result tensor with p's strides
                strided.append((offset, p.shape, p.stride()))
            offset += p.numel()
        if buffer.dtype != u_dtype or strided:
            fut = start_exchange(state, u_flat, keys)
            fut = then(fut, lambda f: _to_bucket_layout(f.value().to(buffer.dtype), strided))
        else:  # d straight into the bucket (its gradients are encoded already): DDP then has nothing to copy
            fut = start_exchange(state, u_flat, keys, out=buffer)
        return state.buckets.finish(bucket, _sample_directions(state, fut, items))
    except BaseException:
        state.unstage([b.param for b in items])  # nothing of the bucket stays staged
        raise


def _to_bucket_layout(d: torch.Tensor, strided: list) -> torch.Tensor:
    """Put each listed parameter's segment of ``d`` (built in logical order, so that the bits' counters follow
    the logical index as in ``Birder.step()``) into the bucket's memory order, in which DDP reads it back."""
    for offset, shape, stride in strided:
        segment = d[offset : offset + math.prod(shape)].clone()
        d.as_strided(shape, stride, d.storage_offset() + offset).copy_(segment.view(shape))
    return d


# ------------------------------------------------------------------------------------------- helpers
def unwrap_ddp(model) -> torch.nn.parallel.DistributedDataParallel:
    """The ``DistributedDataParallel`` module inside ``model`` (a ``torch.compile``-d model keeps it in ``_orig_mod``).

    Raises ``TypeError`` if there is none.
    """
    inner = model
    for _ in range(4):
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
            return inner
        inner = getattr(inner, "_orig_mod", None)
        if inner is None:
            break
    what = f"The 1-bit hook needs a DistributedDataParallel model (or a compiled one), got {type(model).__name__}"
    raise TypeError(
        explain(what, "wrap it in DDP (accelerate's prepare() and the Trainer do, with several processes)")
    )


def attach_ddp_hook(
    model,
    optimizer,
    *,
    topology: Topology | None = None,
    method: str = DEFAULT_METHOD,
    inter_method: str = DEFAULT_INTER_METHOD,
    chunk_numel: int | None = None,
    check_finite: bool = True,
    grad_scaler=None,
):
    """Register the 1-bit hook of ``optimizer`` on the DDP ``model``: ``birder_hook`` for a ``Birder``,
    ``onebit_adam_hook`` for a ``OneBitAdam`` (1-bit Adam has one exchange: ``method``, ``inter_method`` and
    ``chunk_numel`` apply to Birder only; they are validated either way). Returns the hook state.

    ``model`` may be ``torch.compile``-d; ``optimizer`` may be wrapped. If DDP refuses the hook, the optimizer is left
    as it was. With fp16 loss scaling pass the ``GradScaler`` as ``grad_scaler`` (see :class:`BirderHookState`).
    """
    try:  # this rank's checks; a failure stops every rank together (agree_setup), as the hook states' own checks do
        comm = check_settings(method, inter_method, chunk_numel)
        ddp = unwrap_ddp(model)
        opt = unwrap_optimizer(optimizer)
        if not isinstance(opt, OneBitOptimizer):
            raise TypeError(
                f"The 1-bit hook needs a birder_hf.Birder or OneBitAdam optimizer, got {type(opt).__name__}."
            )
    except Exception as exc:
        agree_setup(setup_group(topology), None, exc, what="attach_ddp_hook")
        raise  # not reached: agree_setup raises
    own = opt.ddp_hook(topology=topology, check_finite=check_finite, grad_scaler=grad_scaler)
    if own is not None:  # an optimizer with its own exchange (1-bit Adam)
        state, hook = own
    else:
        state = BirderHookState(opt, topology, comm, check_finite=check_finite, grad_scaler=grad_scaler)
        hook = birder_hook
    try:
        ddp.register_comm_hook(state, hook)
    except BaseException:
        state.detach()  # DDP refused (a hook is already registered): leave the optimizer as it was
        raise
    return state
