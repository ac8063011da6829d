"""1-bit Adam: the error-compensated 1-bit baseline that Birder is compared against.

Paper: `1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed`
(Tang et al., ICML 2021) - https://arxiv.org/abs/2102.02888
Reference code: DeepSpeed's ``OnebitAdam`` + ``compressed_allreduce`` (removed in DeepSpeed 0.19.7).
Deviations from DeepSpeed (``docs/ONEBIT_ADAM.md``):
- One scale per (parameter, shard) instead of one per worker buffer, and shard ownership defined per
  parameter instead of per flattened bucket: nothing depends on DDP's bucket layout, so the error
  buffers live in the optimizer's per-parameter state, survive DDP's bucket rebuild and resume exactly.
- The error buffers are checkpointed and restored (DeepSpeed reset them on every load).
- Warm-up is ``torch.optim.AdamW`` exactly (bias-corrected, decoupled weight decay); after the freeze
  ``v`` and its bias correction stay frozen, ``m``'s bias correction goes on (``bias_correction=False``
  gives DeepSpeed's uncorrected rule). No momentum mask (DeepSpeed's ``exp_avg_mask``).
- Runs on any backend and device (gloo/CPU tested), no cupy, no engine.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as objects.
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from .base import (
    FLAG,
    NON_NEGATIVE,
    OneBitOptimizer,
    Setting,
    Update,
    all_finite,
    choice,
    explain,
    is_integer,
    is_real_number,
    rule,
    state_dtype,
    tensor_problem,
)
from .collectives import Job, Wire, fp32_allreduce_bytes, launch_in_order
from .communicators import DDPBuckets, HookState
from .quantize import pack_bits, unpack_bits
from .topology import Topology

__all__ = ["OneBitAdam", "OneBitAdamHookState", "onebit_adam_hook", "compress_with_feedback", "shard_layout"]

SCALINGS = ("l2", "l1")


def _betas_problem(betas) -> str | None:
    ok = isinstance(betas, tuple) and len(betas) == 2 and all(is_real_number(b) and 0 <= b < 1 for b in betas)
    return None if ok else "{name} must be two floats in [0, 1), e.g. (0.9, 0.999)"


class OneBitAdam(OneBitOptimizer):
    r"""1-bit Adam (Tang et al., ICML 2021): Adam during warm-up, then 1-bit compressed momentum.

    Step :math:`t` of rank :math:`r` of :math:`n`, local gradient :math:`g^r_t`, :math:`T` = ``freeze_step``:

    .. math::
        t \le T:&\quad \bar g_t = \tfrac1n \textstyle\sum_r g^r_t,\ m_t = \beta_1 m_{t-1} + (1-\beta_1)\bar g_t,\
            v_t = \beta_2 v_{t-1} + (1-\beta_2)\bar g_t^2 \quad (\text{AdamW}) \\
        t > T:&\quad x^r = \beta_1 m_{t-1} + (1-\beta_1) g^r_t + e^r,\quad e^r \leftarrow x^r - C(x^r) \\
            &\quad y_s = \tfrac1n \textstyle\sum_r C(x^r)_s + e_s,\quad e_s \leftarrow y_s - C(y_s)
            \quad (\text{shard } s \text{, on its owner}) \\
            &\quad m_t = \bar m_t = [C(y_1), \dots, C(y_n)],\quad v_t = v_T \\
        &\quad \theta_t = \theta_{t-1}(1 - \eta\lambda) - \eta\, \frac{m_t / (1-\beta_1^t)}
            {\sqrt{v_t / (1-\beta_2^{\min(t, T)})} + \epsilon}

    with :math:`C(z) = s \cdot \mathrm{sign}(z)` per chunk (``sign(0) = +1``), :math:`s = \|z\|_2 /
    \sqrt{d}` (DeepSpeed's, ``scaling="l2"``) or :math:`\|z\|_1 / d` (``"l1"``, the least-squares
    scale). The chunks are the :math:`n` shards of each parameter (``shard_layout``).

    Under DDP, :func:`onebit_adam_hook` (its communicator, ``birder_hf.base``) does the communication during
    backward (a full-precision average while :math:`t \le T`, then the two-stage 1-bit exchange) and ``step()``
    applies the update.
    In one process ``step()`` does it all (with :math:`n = 1`, still compressing after the freeze).

    State per parameter: ``"step"``, ``"exp_avg"`` (:math:`m`, identical on every rank), ``"exp_avg_sq"``
    (:math:`v`, identical), and from step :math:`T+1` ``"worker_error"`` (:math:`e^r`, full size) and
    ``"server_error"`` (:math:`e_s`, this rank's shard only) with ``"server_shard"`` = ``(rank, world)``.
    ``m``, ``v`` and the errors are at least float32. The error buffers are rank-local: save them with
    ``birder_hf.checkpoint.save_rank_state`` (one file per rank).

    Args:
        params (`iterable`): parameters or param groups.
        lr (`float`, *optional*, defaults to `1e-3`): learning rate :math:`\eta` (>= 0).
        betas (`tuple[float, float]`, *optional*, defaults to `(0.9, 0.999)`): :math:`\beta_1, \beta_2` in [0, 1).
        eps (`float`, *optional*, defaults to `1e-8`): :math:`\epsilon` (>= 0).
        weight_decay (`float`, *optional*, defaults to `0.0`): decoupled (AdamW) weight decay :math:`\lambda`.
        freeze_step (`int`): :math:`T` >= 1, the number of full-precision warm-up steps; the paper warms
            up for about 15-25% of training (``v`` must have settled before it is frozen). Required.
        bias_correction (`bool`, *optional*, defaults to `True`): Adam's bias correction (``False``:
            DeepSpeed's rule, :math:`\theta \mathrel{-}= \eta (m / (\sqrt v + \epsilon) + \lambda\theta)`).
        scaling (`str`, *optional*, defaults to `"l2"`): the scale of :math:`C`, ``"l2"`` or ``"l1"``.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=2)  # 2 Adam steps, then 1-bit momentum
        >>> for _ in range(3):
        ...     model(torch.randn(8, 4)).square().mean().backward()
        ...     opt.step()
        ...     opt.zero_grad()
    """

    settings = {
        "lr": NON_NEGATIVE,
        "betas": Setting(_betas_problem),
        "eps": NON_NEGATIVE,
        "weight_decay": NON_NEGATIVE,
        "freeze_step": rule(
            lambda v: is_integer(v) and v >= 1,
            "an int >= 1: the number of full-precision Adam warm-up steps, after which the variance is frozen (with "
            "0 it would stay zero); the paper uses about 15-25% of training",
        ),
        "bias_correction": FLAG,
        "scaling": choice(SCALINGS),
    }
    state_keys = ("step", "exp_avg", "exp_avg_sq", "worker_error", "server_error", "server_shard")
    required_state = ("step", "exp_avg", "exp_avg_sq")
    takes_all_reduce_settings = False  # its own two-stage exchange
    loss_scaling = False  # its hook encodes the scaled gradients, and Adam's step depends on their scale
    sharding_refusal = (
        "1-bit Adam on FSDP shards is not implemented (its error feedback is per worker); use Birder, or 1-bit "
        "Adam with DDP (attach_ddp_hook)."
    )
    metrics_prefix = "onebit_adam/"
    card_keys = ("lr", "betas", "eps", "weight_decay", "freeze_step", "bias_correction", "scaling")
    card_name = "1-bit Adam (Tang et al. ICML 2021; birder-hf OneBitAdam)"
    card_title = "## Trained with 1-bit Adam (birder-hf)"
    card_summary = (
        "This model was trained with birder-hf's 1-bit Adam (Tang et al., ICML 2021): full-precision Adam for "
        "`freeze_step` steps, then the momentum is exchanged as 1-bit signs with error feedback."
    )
    tensor_state = ("exp_avg", "exp_avg_sq", "worker_error")

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        freeze_step: int,
        bias_correction: bool = True,
        scaling: str = "l2",
    ):
        betas = tuple(betas) if isinstance(betas, (tuple, list)) else betas
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "freeze_step": freeze_step,
                    "bias_correction": bias_correction, "scaling": scaling}  # fmt: skip
        super().__init__(params, defaults)  # validates every setting and parameter

    def ddp_hook(self, *, topology, check_finite: bool, grad_scaler):
        state = OneBitAdamHookState(self, topology=topology, check_finite=check_finite, grad_scaler=grad_scaler)
        return state, onebit_adam_hook

    def _state_problem(self, p: torch.Tensor, state: dict, group: dict) -> str | None:
        problem = super()._state_problem(p, state, group)
        if problem is not None:
            return problem
        if not bool((state["exp_avg_sq"] >= 0).all()):
            return "has a negative exp_avg_sq"
        if ("server_error" in state) != ("server_shard" in state):
            return "has only one of server_error and server_shard"
        if "server_shard" in state:
            shard = state["server_shard"]
            if (
                not (isinstance(shard, (tuple, list)) and len(shard) == 2 and all(map(is_integer, shard)))
                or not 0 <= shard[0] < shard[1]
            ):
                return f"has server_shard={shard!r}, not (rank, world_size)"
            length = shard_layout(p.numel(), shard[1])[1][shard[0]]
            return tensor_problem(state, "server_error", (length,))
        return None

    # --------------------------------------------------------------------- protocol for communicators
    def init_state(self, p: torch.Tensor, group: dict | None = None) -> dict:
        """The state of ``p`` (created on first use: ``step`` 0, zero ``m`` and ``v``, at least float32)."""
        state = self.state[p]
        if len(state) == 0:
            if p.is_complex() or not p.is_floating_point():
                raise TypeError(f"OneBitAdam supports real floating-point parameters, got {p.dtype}.")
            dtype = state_dtype(p)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
        return state

    def init_error_buffers(self, p: torch.Tensor, rank: int, world: int) -> dict:
        """Create ``p``'s error buffers at its first compressed step (warm-up costs what Adam costs).

        The server error is this rank's shard of the parameter; a state saved under another layout cannot be
        re-sharded, so it restarts from zero (with a warning).
        """
        state = self.state[p]
        if "worker_error" not in state:
            state["worker_error"] = torch.zeros_like(state["exp_avg"])
        if state.get("server_shard") != (rank, world):
            if "server_shard" in state:
                what = f"OneBitAdam: the server error was saved for {state['server_shard'][1]} ranks, not {world}"
                fix = "it restarts from zero (m, v kept); resume with the same world size to continue exactly"
                warnings.warn(explain(what, fix), UserWarning, stacklevel=4)
            _, lens = shard_layout(p.numel(), world)
            state["server_error"] = state["exp_avg"].new_zeros(lens[rank])
            state["server_shard"] = (rank, world)
        return state

    def compressing(self, p: torch.Tensor, group: dict) -> bool:
        """Whether ``p``'s next step is past the warm-up (its momentum is then sent in 1 bit)."""
        return int(self.init_state(p, group)["step"]) >= group["freeze_step"]

    # ------------------------------------------------------------------------------------------- step
    def _step_alone(self) -> bool:
        batch = self.gradients()
        if not all_finite([g for gg in batch for g in gg.grads]):  # as Birder: skip, m and v untouched
            message = "OneBitAdam: non-finite gradient; this step was skipped (state untouched)."
            warnings.warn(message, RuntimeWarning, stacklevel=4)
            return True
        self.check_state_matches([p for gg in batch for p in gg.params])  # before any parameter is stepped
        for group, params, grads in batch:
            for p, grad in zip(params, grads):
                st = self.init_state(p, group)
                if not self.compressing(p, group):
                    _adam_update(p, st, group, grad=grad)
                    continue
                # one process: the same compression with n = 1 (worker, then server, error feedback)
                self.init_error_buffers(p, 0, 1)
                x = _local_momentum(st, grad, group)
                signs, scales, ew = compress_with_feedback(x, 1, group["scaling"])
                bits, scale, es = _server_compress(signs, scales, st["server_error"], group["scaling"])
                st["worker_error"], st["server_error"] = ew.view_as(p), es
                st["exp_avg"] = _decompress(bits, scale, x.dtype).view_as(p)
                _adam_update(p, st, group)
        return False

    def _step_communicated(self, updates: list[Update] | None) -> None:
        # None: a rank had a non-finite gradient, and every rank skips the step; a direction is the hook's record
        for group, params, records in updates or ():
            for p, record in zip(params, records):
                st = self.state[p]
                if isinstance(record, _Warmup):
                    # the averaged gradient; .grad may have been clipped or unscaled since (as with AdamW)
                    _adam_update(p, st, group, grad=p.grad if p.grad is not None else record.grad)
                    continue
                if record.m_bar is None:
                    raise RuntimeError("onebit_adam_hook's communication did not finish before optimizer.step().")
                st["worker_error"] = record.worker_error
                st["exp_avg"] = record.m_bar
                st["server_error"] = record.server_error
                _adam_update(p, st, group)


def _local_momentum(st: dict, grad: torch.Tensor, group: dict) -> torch.Tensor:
    # x = beta1 m + (1 - beta1) g_local + e_worker, flat (a new tensor: m stays until step() commits)
    m = st["exp_avg"]
    x = torch.lerp(m, grad.reshape(m.shape).to(m.dtype), 1 - group["betas"][0])
    return x.add_(st["worker_error"]).reshape(-1)


def _adam_update(p: torch.Tensor, st: dict, group: dict, grad: torch.Tensor | None = None) -> None:
    """AdamW's update, op for op as ``torch.optim.AdamW(foreach=False)``; ``grad=None``: the compressed
    phase (``m`` was already replaced by the synchronized one, ``v`` frozen with its bias correction)."""
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    m, v = st["exp_avg"], st["exp_avg_sq"]
    st["step"] += 1
    step = st["step"].item()
    x = p.float() if p.dtype != m.dtype else p  # low-precision params: update in float32, round once
    if wd != 0:
        x.mul_(1 - lr * wd)
    if grad is not None:
        g = grad.to(m.dtype)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if group["bias_correction"]:
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2 ** min(step, group["freeze_step"])) ** 0.5
    else:
        bias_correction1 = bias_correction2_sqrt = 1.0
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    x.addcdiv_(m, denom, value=-lr / bias_correction1)
    if x is not p:
        p.copy_(x)


# ------------------------------------------------------------------------------------------ compressor
def shard_layout(numel: int, world_size: int) -> tuple[int, list[int]]:
    """``(c, lens)``: rank ``r`` owns elements ``[r*c, r*c + lens[r])`` of a flattened parameter.

    ``c = ceil(numel / world_size)``; the last shards may be short or empty. The layout depends on the
    parameter alone, never on DDP's buckets.
    """
    c = -(-numel // world_size)
    return c, [max(0, min(c, numel - r * c)) for r in range(world_size)]


def _scales(rows: torch.Tensor, numel: int, scaling: str) -> torch.Tensor:
    # rows (m, c) hold numel values, zero-padded (padding adds nothing to either norm); row r holds
    # min(c, numel - r c) of them, counted on the device (a tensor built from a host list is a copy per call)
    m, c = rows.shape
    n = (numel - c * torch.arange(m, device=rows.device)).clamp_(0, c).to(rows.dtype)
    if scaling == "l2":
        s = torch.linalg.vector_norm(rows, dim=1) / n.sqrt()
    else:
        s = rows.abs().sum(dim=1) / n
    return torch.where(n > 0, s, 0.0).to(torch.float32)  # the wire carries float32 scales


def _decompress(signs: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # (m, c) bool signs, (m,) float32 scales -> (m, c) values +-scale
    s = scales.to(dtype).unsqueeze(1)
    return torch.where(signs, s, -s)


def compress_with_feedback(x: torch.Tensor, world_size: int, scaling: str = "l2"):
    """1-bit compression of a flat ``x`` split into ``shard_layout(x.numel(), world_size)`` chunks.

    Returns:
        ``(signs, scales, error)``: ``signs`` (``world_size``, c) bool (``True`` = +1, ``sign(0) = +1``),
        zero-padded chunks; ``scales`` (``world_size``,) float32; ``error = x - decompressed``, flat, so
        that ``decompressed + error == x`` up to one rounding.
    """
    numel = x.numel()
    c, _ = shard_layout(numel, world_size)
    rows = x.new_zeros(world_size * c)
    rows[:numel] = x.reshape(-1)
    rows = rows.view(world_size, c)
    scales = _scales(rows, numel, scaling)
    signs = rows >= 0
    error = rows.sub_(_decompress(signs, scales, rows.dtype)).view(-1)[:numel]
    return signs, scales, error


def _server_compress(signs: torch.Tensor, scales: torch.Tensor, error: torch.Tensor, scaling: str):
    """The shard owner: average the ``n`` workers' compressed chunks, add the server error, re-compress.

    Returns ``(signs (1, len), scale (1,), new error)`` with ``decompressed + new error == mean + error``.
    """
    mean = _decompress(signs, scales, error.dtype).sum(dim=0).div_(signs.shape[0])
    return compress_with_feedback(mean[: error.numel()].add_(error), 1, scaling)


# ---------------------------------------------------------------------------------------------- hook
class _Warmup(NamedTuple):
    grad: torch.Tensor  # a view of the bucket: averaged over the ranks in place


@dataclass
class _Compressed:
    worker_error: torch.Tensor  # the new e^r
    m_bar: torch.Tensor | None = None  # the synchronized momentum, once the exchange finished
    server_error: torch.Tensor | None = None  # the new e_s of this rank's shard


class OneBitAdamHookState(HookState):
    """State of :func:`onebit_adam_hook`: the optimizer, the topology and the traffic counters.

    Args:
        optimizer (`OneBitAdam`): the optimizer of the DDP model's parameters; one hook state each.
        topology (`Topology`, *optional*): its ``world_group`` carries the traffic; defaults to
            ``Topology.flat()`` (a dedicated copy of the default group, apart from DDP's own collectives).
        check_finite (`bool`, *optional*, defaults to `True`): skip a step on every rank when any rank has a
            non-finite gradient (``m``, ``v`` and the error buffers stay as they were).

    Attributes:
        stats (`CommStats`): bytes this rank sent, all steps (warm-up counted as a ring all-reduce).
        last_step_stats (`CommStats`): the same for the last completed ``optimizer.step()``.
        warmup_steps, compressed_steps (`int`): steps the hook communicated in each phase.
    """

    optimizer_class = OneBitAdam
    hook_name = "onebit_adam_hook"
    loss_scale_invariant = False  # Adam's step and the compressed momentum's scale follow the gradient's scale

    __slots__ = ("warmup_steps", "compressed_steps", "buckets")

    def __init__(
        self, optimizer: OneBitAdam, topology: Topology | None = None, *, check_finite: bool = True, grad_scaler=None
    ):
        self.warmup_steps = self.compressed_steps = 0
        super().__init__(optimizer, topology, check_finite=check_finite, grad_scaler=grad_scaler)
        self.buckets = DDPBuckets(self)  # DDP's side: where each gradient lies in its bucket

    def metrics(self) -> dict[str, float]:
        return {**super().metrics(), self.optimizer.metrics_prefix + "compressed_steps": self.compressed_steps}

    def _check_setup(self, optimizer, topology) -> None:
        super()._check_setup(optimizer, topology)
        if len({g["freeze_step"] for g in optimizer.param_groups}) > 1:
            what = "The param groups' freeze_step differ, but a DDP bucket is averaged in full precision or compressed"
            raise ValueError(explain(what, "all param groups must share one freeze_step under onebit_adam_hook"))

    @property
    def description(self) -> str:
        return "1-bit Adam hook"

    def finish_step(self) -> list[Update] | None:
        """Agree the step is finite and hand ``step()`` each parameter's record of the exchange as its direction."""
        staged = self.take_staged()
        if staged is None:
            return None
        kinds = {type(s.record) for s in staged.values()}
        self.warmup_steps += _Warmup in kinds
        self.compressed_steps += _Compressed in kinds
        groups = [(g, [p for p in g["params"] if p in staged]) for g in self.optimizer.param_groups]
        return [Update(g, ps, [staged[p].record for p in ps]) for g, ps in groups if ps]


def onebit_adam_hook(state: OneBitAdamHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook of :class:`OneBitAdam` (see its docstring for the math).

    Warm-up (``step < freeze_step``): the full-precision average of the bucket, as DDP's ``allreduce_hook``.
    Afterwards the two-stage exchange of :class:`OneBitAdam`'s math: an all-to-all of each parameter's compressed
    shards, each owner's re-compressed mean, an all-gather. The Future holds the synchronized momentum ``m_bar``
    (DDP writes it into ``.grad``); ``optimizer.step()`` commits ``m = m_bar`` and the error buffers, then updates.

    One all-to-all and one all-gather of ``(c/8 + 4k)`` bytes per peer per bucket (``c`` the elements
    of one shard of the bucket's ``k`` parameters, padded to whole bytes).
    """
    items = state.buckets.begin(bucket)
    try:
        return state.buckets.finish(bucket, _start_bucket(state, bucket.buffer(), items))
    except BaseException:
        state.unstage([item.param for item in items])  # nothing of the bucket stays staged
        raise


def _start_bucket(state: OneBitAdamHookState, buffer: torch.Tensor, items: list) -> torch.futures.Future:
    opt, topo = state.optimizer, state.topology
    n, rank = topo.world_size, topo.rank
    opt.check_state_matches([item.param for item in items])
    phases = {opt.compressing(item.param, item.group) for item in items}
    if len(phases) > 1:
        what = "A DDP bucket holds parameters in both phases (their step counts differ)"
        raise RuntimeError(explain(what, "step every parameter together, and checkpoint the state of every one"))
    stats = state.step_stats
    stats.calls += 1
    stats.fp32_allreduce_bytes += fp32_allreduce_bytes(buffer.numel(), n)

    if not phases or not phases.pop():  # warm-up: average in full precision (allreduce_hook)
        for item in items:
            state.stage(item.param, item.group, _Warmup(item.grad))
        moved = [item for item in items if item.grad.stride() != item.in_place.stride()]

        def start(wire):
            buffer.div_(n)
            # a ring all-reduce sends 2(n-1)/n of the buffer, split over the peers
            return wire.all_reduce_sum(buffer, "world", 2 * buffer.numel() * buffer.element_size() / n)

        def finish(wire, recv):
            for item in moved:  # DDP reads this parameter back in another order than it filled it in
                item.in_place.copy_(item.grad.clone())
            return recv

        return launch_in_order(topo, Job(Wire(topo, stats), start, finish))

    # compressed: worker side, here on the autograd thread
    layout, records, signs_list, scales_list, col = [], [], [], [], 0
    for p, g, group, _, in_place in items:
        st = opt.init_error_buffers(p, rank, n)
        signs, scales, ew = compress_with_feedback(_local_momentum(st, g, group), n, group["scaling"])
        record = _Compressed(ew.view_as(p))
        state.stage(p, group, record)
        records.append(record)
        signs_list.append(signs)
        scales_list.append(scales)
        layout.append(_Segment(col, signs.shape[1], in_place, st["server_error"], group["scaling"], p.shape))
        col += signs.shape[1]
    nbytes = -(-col // 8)
    bits = torch.zeros(n, 8 * nbytes, dtype=torch.bool, device=buffer.device)
    for seg, signs in zip(layout, signs_list):
        bits[:, seg.col : seg.col + seg.width] = signs
    send = _frame(bits, torch.stack(scales_list, dim=1))

    def start(wire):
        return wire.all_to_all(send, "world")

    def finish(wire, recv):
        # server side: average my shard of every parameter, add the server error, re-compress
        in_bits, in_scales = _unframe(recv.view(n, -1), nbytes)
        out_bits = torch.zeros(8 * nbytes, dtype=torch.bool, device=buffer.device)
        out_scales = []
        for j, (seg, record) in enumerate(zip(layout, records)):
            cols = slice(seg.col, seg.col + seg.width)
            signs, scale, record.server_error = _server_compress(
                in_bits[:, cols], in_scales[:, j], seg.server_error, seg.scaling
            )
            out_bits[seg.col : seg.col + seg.server_error.numel()] = signs[0]
            out_scales.append(scale)
        mine = _frame(out_bits.view(1, -1), torch.cat(out_scales).view(1, -1))
        # everyone: the n owners' compressed shards make m_bar, bitwise the same on every rank
        all_bits, all_scales = _unframe(wire.all_gather_sync(mine, "world").view(n, -1), nbytes)
        for j, (seg, record) in enumerate(zip(layout, records)):
            cols = slice(seg.col, seg.col + seg.width)
            m_bar = _decompress(all_bits[:, cols], all_scales[:, j], seg.server_error.dtype).view(-1)
            record.m_bar = m_bar[: seg.out.numel()].view(seg.shape)
            # the local gradients were consumed above: the bucket now carries m_bar, in the order DDP reads it back
            seg.out.copy_(record.m_bar)
        return buffer

    return launch_in_order(topo, Job(Wire(topo, stats), start, finish))


class _Segment(NamedTuple):
    col: int  # first column of this parameter in the bucket's shard rows
    width: int  # its shard width
    out: torch.Tensor  # the bucket's view that DDP reads this parameter's result from
    server_error: torch.Tensor  # this rank's shard's error buffer
    scaling: str
    shape: torch.Size


def _frame(bits: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    # one uint8 message per destination row: packed signs, then the float32 scales' bytes
    packed = pack_bits(bits.reshape(-1)).view(bits.shape[0], -1)
    return torch.cat([packed, scales.contiguous().view(torch.uint8)], dim=1).reshape(-1)


def _unframe(rows: torch.Tensor, nbytes: int):
    bits = unpack_bits(rows[:, :nbytes].contiguous(), rows.shape[0] * 8 * nbytes).view(rows.shape[0], 8 * nbytes)
    # a fresh copy, not contiguous(): a one-row slice counts as contiguous at an offset a float view refuses
    return bits, rows[:, nbytes:].clone(memory_format=torch.contiguous_format).view(torch.float32)
