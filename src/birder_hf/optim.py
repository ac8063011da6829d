"""Birder: 1-bit adaptive optimizer with Hierarchical-1-bit-All-Reduce.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB
Official code: https://openi.pcl.ac.cn/c2net_optim/Birder

Deviations from the paper (its full text and code were not available to us; ``docs/ALGORITHM.md``):
- The update equations below are our reconstruction from the abstract, the seed's flags and the
  footnote on Algorithm 1: one ``beta`` for the EMA of the gradient and of its absolute value, so that
  ``|m| <= b`` and ``u = m / b`` lies in ``[-1, 1]``.
- The random bits come from a counter-based hash keyed by (seed, step, parameter, stage, rank), see
  ``birder_hf.quantize``, so that resume is exact and the bits do not depend on DDP's bucket layout.
- ``quantize=False`` and ``amsgrad=True`` are opt-in extras (a single-process reference, and the
  max-variant the paper uses only in its theory).
- Steps with a non-finite gradient are skipped (state and parameters untouched) with a warning.

This module never imports ``torch.distributed``; communication lives in ``collectives`` and ``hook``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.optim.optimizer import Optimizer

from .checkpoint import RankLocalState, state_dtype
from .quantize import STAGE_WORKER, BitKeys, derive_key, quantize_bits

__all__ = ["Birder", "birder"]

# u = m / max(b, _TINY): equals m / b wherever b is a normal float32, and 0 where b = 0 (then m = 0).
_TINY = torch.finfo(torch.float32).tiny


class Birder(RankLocalState, Optimizer):
    r"""Birder: the 1-bit adaptive optimizer (our reconstruction of Peng et al., NeurIPS 2023).

    Per parameter, with local gradient :math:`g_t`:

    .. math::
        m_t &= \beta m_{t-1} + (1 - \beta) g_t \\
        b_t &= \beta b_{t-1} + (1 - \beta) |g_t| \qquad (|m_t| \le b_t) \\
        u_t &= m_t / b_t \quad (0 \text{ where } b_t = 0), \qquad u_t \in [-1, 1] \\
        q_t &= Q(u_t), \quad P(q_{t,j} = +1) = (1 + u_{t,j}) / 2 \qquad (E[q_t] = u_t) \\
        d_t &= \text{OneBitAllReduce}(q_t) \quad (\text{or } q_t \text{ in one process}) \\
        x_t &= x_{t-1} - \eta_t (d_t + \lambda x_{t-1})

    Every step moves each coordinate by at most :math:`\eta (1 + \lambda |x|)`. There is no
    uncompressed warm-up: compression is on from the first step.

    Three ways to run it:

    - one process: ``step()`` does everything;
    - under DDP with :func:`birder_hf.birder_hook` (the fast path): the hook updates ``m`` and ``b``,
      quantizes and runs the 1-bit all-reduce during backward, DDP writes :math:`d` into ``.grad``,
      and ``step()`` only applies the last line. The hook state switches this mode on explicitly;
    - without DDP, pass ``process_group=`` or ``topology=``: ``step()`` runs the 1-bit all-reduce.

    State: per parameter ``"step"`` (a CPU float32 scalar, as in ``torch.optim``), ``"exp_avg"``
    (:math:`m`), ``"exp_avg_abs"`` (:math:`b`) and, with ``amsgrad``, ``"max_exp_avg_abs"``. ``m`` and
    ``b`` are at least float32: bf16/fp16 parameters get float32 state, and their update is computed
    in float32 and rounded once to the parameter's dtype. The state is rank-local: each rank's own
    gradients; ``birder_hf.checkpoint`` saves one file per rank.

    Edge cases: parameters without ``.grad`` are skipped (no state, step not counted); zero-size
    parameters are allowed; sparse gradients raise; coordinates whose gradient has always been 0 have
    :math:`b = 0`, hence :math:`u = 0` and a fair coin :math:`q = \pm 1` (mean 0: unbiased, but with
    ``quantize=True`` they random-walk by :math:`\pm\eta`); with ``quantize=False`` they only decay.

    Args:
        params (`iterable`): parameters or param groups.
        lr (`float`, *optional*, defaults to `1e-3`): learning rate :math:`\eta` (>= 0).
        beta (`float`, *optional*, defaults to `0.95`): EMA factor :math:`\beta` in ``[0, 1)``.
        weight_decay (`float`, *optional*, defaults to `0.0`): decoupled weight decay :math:`\lambda` (>= 0).
        quantize (`bool`, *optional*, defaults to `True`): binary randomization; ``False`` uses
            :math:`d = u` (single process only; a reference, not 1-bit).
        amsgrad (`bool`, *optional*, defaults to `False`): use :math:`\max_{s \le t} b_s` (the theory's variant).
        seed (`int`, *optional*): seed of the counter-based random bits; by default drawn from torch's
            default generator (so ``torch.manual_seed`` makes runs repeatable). Saved in ``state_dict``.
        foreach (`bool`, *optional*): use the multi-tensor path (default: on CUDA tensors).
        maximize (`bool`, *optional*, defaults to `False`): maximize the objective.
        process_group (`ProcessGroup`, *optional*): run the 1-bit all-reduce in ``step()`` over this group.
        topology (`birder_hf.Topology`, *optional*): as ``process_group``, with a node topology.
        comm_method (`str`, *optional*, defaults to `"allgather"`): the ``onebit_all_reduce`` method
            used with ``process_group``/``topology``.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Birder(model.parameters(), lr=1e-3, beta=0.95, weight_decay=0.1, seed=0)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        beta: float = 0.95,
        weight_decay: float = 0.0,
        *,
        quantize: bool = True,
        amsgrad: bool = False,
        seed: int | None = None,
        foreach: bool | None = None,
        maximize: bool = False,
        process_group=None,
        topology=None,
        comm_method: str = "allgather",
    ):
        if not isinstance(lr, (int, float)) or lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr!r}; lr must be a float >= 0.")
        if not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta: {beta!r}; beta must lie in [0, 1) (the paper uses 0.95).")
        if not isinstance(weight_decay, (int, float)) or weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay: {weight_decay!r}; weight_decay must be >= 0.")
        if process_group is not None and topology is not None:
            raise ValueError("Pass process_group= or topology=, not both.")
        if seed is None:
            seed = int(torch.randint(0, 2**31 - 1, ()).item())
        defaults = dict(
            lr=lr,
            beta=beta,
            weight_decay=weight_decay,
            quantize=quantize,
            amsgrad=amsgrad,
            seed=int(seed),
            foreach=foreach,
            maximize=maximize,
        )
        super().__init__(params, defaults)
        if topology is None and process_group is not None:
            from .topology import Topology

            topology = Topology.flat(process_group)
        if topology is not None and not quantize:
            raise ValueError("quantize=False sends full-precision u and is for one process only; drop it.")
        self._topology = topology
        self._comm_method = comm_method
        self._hook_state = None  # set by BirderHookState: DDP's hook owns m, b and the all-reduce
        self._param_ids: dict[torch.Tensor, tuple[int, dict]] | None = None

    def add_param_group(self, param_group: dict) -> None:
        for name, check in (
            ("lr", lambda v: v >= 0),
            ("beta", lambda v: 0 <= v < 1),
            ("weight_decay", lambda v: v >= 0),
        ):
            if name in param_group and not check(param_group[name]):
                raise ValueError(f"Invalid {name} {param_group[name]!r} in a param group")
        super().add_param_group(param_group)
        self._param_ids = None

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("_topology", None)
        self.__dict__.setdefault("_comm_method", "allgather")
        self.__dict__.setdefault("_hook_state", None)
        self.__dict__.setdefault("_param_ids", None)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict; ``m`` and ``b`` of bf16/fp16 parameters stay float32, and a rank's own staged state
        wins (``birder_hf.checkpoint.RankLocalState``)."""
        super().load_state_dict(state_dict)
        self._param_ids = None

    @property
    def seed(self) -> int:
        return int(self.param_groups[0]["seed"])

    def _index(self) -> dict[torch.Tensor, tuple[int, dict]]:
        # param -> (its index over all groups, its group); rebuilt after add_param_group / load_state_dict,
        # which replace the group dicts
        if self._param_ids is None:
            pairs = [(p, g) for g in self.param_groups for p in g["params"]]
            self._param_ids = {p: (i, g) for i, (p, g) in enumerate(pairs)}
        return self._param_ids

    def param_index(self, p: torch.Tensor) -> int:
        """The stable index of ``p`` in the optimizer (its order over all param groups); keys its bits."""
        return self._index()[p][0]

    def group_of(self, p: torch.Tensor) -> dict | None:
        """The param group that holds ``p`` (``None`` if the optimizer does not own it)."""
        entry = self._index().get(p)
        return None if entry is None else entry[1]

    def _init_state(self, p: torch.Tensor, amsgrad: bool) -> dict:
        state = self.state[p]
        if len(state) == 0:
            dtype = state_dtype(p)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_abs"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_abs" not in state:
            state["max_exp_avg_abs"] = state["exp_avg_abs"].clone()
        return state

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """Perform one optimization step (see the class docstring for what runs where)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._hook_state is not None:
            self._apply_directions()
            return loss
        if self._topology is None:
            _warn_if_ddp_without_hook()

        groups = []
        for group in self.param_groups:
            params, grads = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Birder does not support sparse gradients; use dense ones (sparse=False).")
                params.append(p)
                grads.append(p.grad)
            if params:
                groups.append((group, params, grads))
        if not groups:
            return loss
        if not self._all_finite([g for _, _, gs in groups for g in gs]):
            warnings.warn(
                "Birder: non-finite gradient; this step was skipped (state untouched).", RuntimeWarning, stacklevel=3
            )
            return loss

        rank = self._topology.rank if self._topology is not None else 0
        work = []  # (group, params, directions) to apply after a joint all-reduce
        for group, params, grads in groups:
            states = [self._init_state(p, group["amsgrad"]) for p in params]
            for s in states:
                s["step"] += 1
            directions = birder(
                params,
                grads,
                [s["exp_avg"] for s in states],
                [s["exp_avg_abs"] for s in states],
                [s.get("max_exp_avg_abs") for s in states] if group["amsgrad"] else None,
                keys=[
                    derive_key(group["seed"], int(s["step"]), self.param_index(p), STAGE_WORKER, rank)
                    for p, s in zip(params, states)
                ],
                lr=group["lr"],
                beta=group["beta"],
                weight_decay=group["weight_decay"],
                quantize=group["quantize"] and self._topology is None,
                maximize=group["maximize"],
                foreach=group["foreach"],
                apply=self._topology is None,
            )
            if self._topology is not None:
                work.append((group, params, states, directions))
        if work:
            self._all_reduce_and_apply(work)
        return loss

    def _all_finite(self, tensors: list[torch.Tensor]) -> bool:
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for t in tensors:
            if t.numel():
                by_device.setdefault(t.device, []).append(t)
        # the max-norm is inf or NaN exactly when an element is (a 2-norm would overflow on finite values)
        ok = all(
            bool(torch.stack([n.float() for n in torch._foreach_norm(ts, float("inf"))]).isfinite().all())
            for ts in by_device.values()
        )
        if self._topology is not None:
            import torch.distributed as dist  # lazy: only the explicit process-group mode needs it

            dev = tensors[0].device if tensors else torch.device("cpu")
            flag = torch.tensor([0.0 if ok else 1.0], device=dev)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._topology.world_group)
            ok = flag.item() == 0.0
        return ok

    def _all_reduce_and_apply(self, work) -> None:
        from .collectives import onebit_all_reduce

        params = [p for _, ps, _, _ in work for p in ps]
        us = [u for _, _, _, ds in work for u in ds]
        steps = [int(s["step"]) for _, _, ss, _ in work for s in ss]
        flat = torch.cat([u.reshape(-1) for u in us])
        keys = BitKeys(self.seed, steps, [self.param_index(p) for p in params], [u.numel() for u in us])
        d = onebit_all_reduce(flat, topology=self._topology, method=self._comm_method, generator=keys)
        offset = 0
        for group, ps, _, ds in work:
            chunks = []
            for u in ds:
                chunks.append(d[offset : offset + u.numel()].view_as(u))
                offset += u.numel()
            _apply_update(ps, chunks, lr=group["lr"], weight_decay=group["weight_decay"])

    def _apply_directions(self) -> None:
        """Hook mode: ``.grad`` holds d from the 1-bit all-reduce; apply x -= lr (d + wd x)."""
        if not self._hook_state._finish_step():
            return  # a rank had a non-finite gradient: every rank skips, m and b were not committed
        seen = self._hook_state._seen_params
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p not in seen:
                    raise RuntimeError(
                        f"A parameter of shape {tuple(p.shape)} has a gradient but the Birder hook did not see it: "
                        "every parameter Birder optimizes must belong to the DDP model the hook is registered on."
                    )
            if params:
                _apply_update(params, [p.grad for p in params], lr=group["lr"], weight_decay=group["weight_decay"])
        seen.clear()


_warned_no_hook = False


def _warn_if_ddp_without_hook() -> None:
    global _warned_no_hook
    if _warned_no_hook:
        return
    import torch.distributed as dist  # only to look: communication lives in collectives/hook

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _warned_no_hook = True
        warnings.warn(
            "Birder is running in a distributed job without its communication hook, so DDP averages "
            "gradients in full precision (32 bits per value) and each rank quantizes on its own. Register "
            "the 1-bit hook: model.register_comm_hook(BirderHookState(optimizer), birder_hook), or "
            "birder_hf.integrations.accelerate.register_birder_hook / BirderCallback for the HF Trainer.",
            UserWarning,
            stacklevel=3,
        )


def _apply_update(params, directions, *, lr: float, weight_decay: float) -> None:
    # x <- x - lr * (d + wd * x) = (1 - lr wd) x - lr d: two in-place passes, no temporaries; in float32 (at least)
    # and rounded once to the param dtype
    decay = 1.0 - lr * weight_decay
    for p, d in zip(params, directions):
        x = p.float() if p.dtype in (torch.float16, torch.bfloat16) else p
        if decay != 1.0:
            x.mul_(decay)
        x.add_(d.to(x.dtype), alpha=-lr)
        if x is not p:
            p.copy_(x)


def birder(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_abss: list[torch.Tensor],
    max_exp_avg_abss: list[torch.Tensor] | None = None,
    *,
    keys: list[tuple[int, int]],
    lr: float,
    beta: float,
    weight_decay: float,
    quantize: bool = True,
    maximize: bool = False,
    foreach: bool | None = None,
    apply: bool = True,
) -> list[torch.Tensor]:
    r"""Functional Birder (see :class:`Birder`): update ``m``, ``b`` in place, compute the directions.

    With ``apply=True`` the parameters are updated and the directions :math:`d` (``Q(u)`` or ``u``)
    are returned; with ``apply=False`` the parameters are left alone and ``u`` is returned (for a
    1-bit all-reduce that quantizes it itself). ``keys[i]`` keys the random bits of ``params[i]``.
    """
    if foreach is None:
        foreach = bool(params) and all(p.is_cuda for p in params)
    fn = _multi_tensor_encode if foreach else _single_tensor_encode
    us = fn(grads, exp_avgs, exp_avg_abss, max_exp_avg_abss, beta=beta, maximize=maximize)
    if not apply:
        return us
    if quantize:
        ds = []
        for u, key in zip(us, keys):
            bits = quantize_bits(u, key).view_as(u)
            ds.append(torch.where(bits, 1.0, -1.0).to(u.dtype))
    else:
        ds = us
    _apply_update(params, ds, lr=lr, weight_decay=weight_decay)
    return ds


def _single_tensor_encode(
    grads, exp_avgs, exp_avg_abss, max_exp_avg_abss, *, beta: float, maximize: bool, out=None, u_out=None
):
    # out = (ms, bs, bmaxs): write the new m, b (and max b) there instead of in place (the DDP hook
    # double-buffers them until every rank agrees the step is finite); u_out: where to write u.
    us = []
    for i, (g, m, b) in enumerate(zip(grads, exp_avgs, exp_avg_abss)):
        m_out, b_out = (out[0][i], out[1][i]) if out is not None else (m, b)
        g = g.to(m.dtype)
        if maximize:
            g = -g
        torch.mul(m, beta, out=m_out).add_(g, alpha=1 - beta)
        torch.mul(b, beta, out=b_out).add_(g.abs(), alpha=1 - beta)
        denom = b_out
        if max_exp_avg_abss is not None:
            bmax_out = out[2][i] if out is not None else max_exp_avg_abss[i]
            torch.maximum(max_exp_avg_abss[i], b_out, out=bmax_out)
            denom = bmax_out
        # |m| <= b holds in floating point (monotone rounding); max(b, tiny) makes 0/0 = 0.
        u = u_out[i] if u_out is not None else torch.empty_like(m_out)
        torch.div(m_out, denom.clamp_min(_TINY), out=u)
        us.append(u.clamp_(-1.0, 1.0))
    return us


def _multi_tensor_encode(grads, exp_avgs, exp_avg_abss, max_exp_avg_abss, *, beta: float, maximize: bool):
    if not grads:
        return []
    grads = [g.to(m.dtype) for g, m in zip(grads, exp_avgs)]
    if maximize:
        grads = torch._foreach_neg(grads)
    torch._foreach_mul_(exp_avgs, beta)
    torch._foreach_add_(exp_avgs, grads, alpha=1 - beta)
    torch._foreach_mul_(exp_avg_abss, beta)
    torch._foreach_add_(exp_avg_abss, torch._foreach_abs(grads), alpha=1 - beta)
    denoms = exp_avg_abss
    if max_exp_avg_abss is not None:
        torch._foreach_maximum_(max_exp_avg_abss, exp_avg_abss)
        denoms = max_exp_avg_abss
    denoms = torch._foreach_clamp_min(denoms, _TINY)
    us = torch._foreach_div(exp_avgs, denoms)
    torch._foreach_clamp_min_(us, -1.0)
    torch._foreach_clamp_max_(us, 1.0)
    return us
