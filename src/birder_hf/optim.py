"""Birder: 1-bit adaptive optimizer with Hierarchical-1-bit-All-Reduce.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB
Official code: https://openi.pcl.ac.cn/c2net_optim/Birder

Deviations from the paper (its full text and code were not available to us; ``docs/ALGORITHM.md``):
- The update equations below are our reconstruction from the abstract, the official code's flags and the
  footnote on Algorithm 1: one ``beta`` for the EMA of the gradient and of its absolute value, so that
  ``|m| <= b`` and ``u = m / b`` lies in ``[-1, 1]``.
- The random bits come from a counter-based hash keyed by (seed, step, parameter, stage, rank pair), see
  ``birder_hf.quantize``, so that resume is exact and the bits do not depend on DDP's bucket layout.
- ``quantize=False`` and ``amsgrad=True`` are opt-in extras (a single-process reference, and the
  max-variant the paper uses only in its theory).
- ``stale`` (ours): what a coordinate does on a step where its gradient is exactly 0 (:class:`Birder`; the paper's
  update, ``stale="keep"``, lets it drift by ``lr`` per step forever). ``docs/ALGORITHM.md`` has the bounds and the
  measurements behind the default.
- Steps with a non-finite gradient are skipped (state and parameters untouched) with a warning.
- ``beta2=`` and ``grad_clip=`` (ours, opt-in, issue 38's candidates; ``docs/ALGORITHM.md``): a second-moment
  direction ``clip(m_hat / (sqrt(v_hat) + eps), -1, 1)`` in place of ``m / b``, and each rank's gradient clipped per
  tensor before it is encoded, and ``error_feedback=`` (a deterministic 1-bit vote whose rounding error each rank
  carries to its next step). Off by default: the paper's update is the default until the quality matrix decides.

The optimizer *encodes* (``m, b -> u``) and *applies* (``x <- x - lr (d + wd x)``); turning every rank's ``u``
into ``d`` is the job of its communicator (``birder_hf.base``, ``docs/ARCHITECTURE.md``). This module imports
``torch.distributed`` only through the optimizer-side communicator it attaches when given ``process_group=`` or
``topology=``.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import torch

from .base import (
    FLAG,
    INTEGER,
    LR,
    NON_NEGATIVE,
    OPTIONAL_FLAG,
    OneBitOptimizer,
    Update,
    all_finite,
    explain,
    is_integer,
    is_real_number,
    local_tensor,
    rule,
    shard_offset,
    shard_record,
    state_dtype,
)
from .quantize import STAGE_WORKER, BitKeys, quantize_bits, register_kernel, run_kernel
from .settings import DEFAULT_METHOD, check_settings

__all__ = ["Birder", "birder", "birder_encode", "birder_apply", "EncodeOut", "StateBuffers"]

STALE_MODES = ("fade", "lazy", "keep")
DEFAULT_STALE = "fade"
# "fade": a stale coordinate stops voting once |u| < STALE_VOTE_MIN: at most ceil(ln(1/20) / ln(beta)) stale steps
STALE_VOTE_MIN = 0.05


def second_moment_keys(group: dict) -> tuple[str, str]:
    """The state keys of a param group's second moment and its max: ``b`` (the paper's ``beta2=None``) or ``v``."""
    return ("exp_avg_abs", "max_exp_avg_abs") if group.get("beta2") is None else ("exp_avg_sq", "max_exp_avg_sq")


# u = m / max(b, _TINY): equals m / b wherever b is a normal float32, and 0 where b = 0 (then m = 0).
_TINY = torch.finfo(torch.float32).tiny


class Birder(OneBitOptimizer):
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

    With ``beta2`` (ours, opt-in) the direction is Adam's, bounded to the range a 1-bit vote carries, and ``b`` is
    replaced by the second moment :math:`v` (state key ``"exp_avg_sq"``; no state is added):

    .. math::
        v_t &= \beta_2 v_{t-1} + (1 - \beta_2) g_t^2 \\
        u_t &= \operatorname{clip}\Big(\frac{m_t / (1 - \beta^t)}{\sqrt{v_t / (1 - \beta_2^t)} + \epsilon}, -1, 1\Big)

    With ``grad_clip`` :math:`c` (ours, opt-in) each rank scales each parameter's gradient (the part it encodes: a
    shard under FSDP) to at most its share of a global norm of :math:`c` before it is encoded,
    :math:`g_i \leftarrow g_i \min(1, c \sqrt{n_i / N} / \lVert g_i \rVert)` (:math:`n_i` its elements, :math:`N`
    the optimizer's parameters' elements): no communication, so the DDP hook can clip bucket by bucket, where a global
    norm would need every bucket first. ``docs/ALGORITHM.md``, "The update rule at other layouts", has the
    measurements; both are off by default.

    With ``error_feedback`` (ours, opt-in) each rank sends the sign of its direction plus the rounding error it kept,
    and keeps the new error (state key ``"vote_error"``, :math:`|e| \le 1`):

    .. math::
        s_t = u_t + e_{t-1}, \qquad q_t = \operatorname{sign}(s_t) \in \{-1, +1\}, \qquad e_t = s_t - q_t

    (where :math:`u_t = 0`, no vote: :math:`q_t = 0` and :math:`e` is kept). The vote no longer draws random bits:
    instead of :math:`E[q_t] = u_t` at every step, :math:`\sum_{s \le t} q_s = \sum_{s \le t} u_s - e_t`, so the
    directions a rank has sent trail what it meant to send by less than 1 per coordinate, at any step
    (sigma-delta modulation; error-feedback signSGD, Karimireddy et al. 2019).

    Where :math:`g_t = 0` exactly (a *stale* coordinate: an embedding row absent from the batch, a dead unit), the
    lines above are the paper's (``stale="keep"``): :math:`m` and :math:`b` decay alike and :math:`u` keeps its last
    value. With ``stale="fade"`` such a coordinate's :math:`m` decays once more, :math:`m_t = \beta^2 m_{t-1}`, so
    :math:`u` shrinks by :math:`\beta` per stale step, and :math:`u_t = 0` once :math:`|u_t| <` ``STALE_VOTE_MIN``:
    a coordinate that stops receiving gradient votes on at most
    :math:`K = \lceil \ln(\text{STALE\_VOTE\_MIN}) / \ln \beta \rceil` more steps (59 for :math:`\beta = 0.95`),
    so it moves by at most :math:`K \eta` in all, weight decay aside. With ``stale="lazy"``, :math:`u_t = 0` on every
    stale step (:math:`K = 0`).

    Who turns :math:`u` into :math:`d` (in one process ``step()`` quantizes locally; the DDP hook, ``process_group=``
    / ``topology=`` and 1-bit HSDP communicate): ``docs/ARCHITECTURE.md``. Sharded parameters keep ``m``, ``b`` for
    their local shard only.

    State: per parameter ``"step"`` (a CPU float32 scalar, as in ``torch.optim``), ``"exp_avg"``
    (:math:`m`), ``"exp_avg_abs"`` (:math:`b`) and, with ``amsgrad``, ``"max_exp_avg_abs"``. ``m`` and
    ``b`` are at least float32: bf16/fp16 parameters get float32 state, and their update is computed
    in float32 and rounded once to the parameter's dtype. The state is rank-local: each rank's own
    gradients; ``birder_hf.checkpoint`` saves one file per rank.

    Edge cases: parameters without ``.grad`` are skipped (no state, step not counted); zero-size
    parameters are allowed; integer and complex parameters, and a parameter listed twice, are refused at
    construction; sparse gradients raise. Coordinates whose gradient has always been 0 have :math:`u = 0`, and
    :math:`d = 0` in one process; across ranks, when :math:`d = 0` too: ``docs/ALGORITHM.md``.

    Args:
        params (`iterable`): parameters or param groups.
        lr (`float` or `Tensor`, *optional*, defaults to `1e-3`): learning rate :math:`\eta` (>= 0); a
            1-element Tensor works too (as in ``torch.optim``: a scheduler may change it in place).
        beta (`float`, *optional*, defaults to `0.95`): EMA factor :math:`\beta` in ``[0, 1)``.
        weight_decay (`float`, *optional*, defaults to `0.0`): decoupled weight decay :math:`\lambda` (>= 0).
        quantize (`bool`, *optional*, defaults to `True`): binary randomization; ``False`` uses
            :math:`d = u` (single process only; a reference, not 1-bit).
        amsgrad (`bool`, *optional*, defaults to `False`): use :math:`\max_{s \le t} b_s` (the theory's variant;
            with ``beta2``, :math:`\max_{s \le t} v_s`).
        beta2 (`float`, *optional*): the second moment's EMA factor in ``[0, 1)``: switches ``u`` to the bounded
            second-moment direction above (``None``, the default: the paper's ``u = m / b``).
        eps (`float`, *optional*, defaults to `1e-8`): with ``beta2``, added to :math:`\sqrt{\hat v}` (> 0).
        grad_clip (`float`, *optional*): clip each parameter's gradient to its share of this global norm before
            encoding (> 0; ``None``, the default: no clipping).
        error_feedback (`bool`, *optional*, defaults to `False`): vote with the sign of ``u`` plus the kept rounding
            error, as above (one more fp32 buffer per parameter).
        stale (`str`, *optional*, defaults to `DEFAULT_STALE`): ``"fade"``, ``"lazy"`` or ``"keep"`` (the paper's),
            as above; ``docs/ALGORITHM.md``, "Coordinates that stop receiving gradient".
        seed (`int`, *optional*): seed of the counter-based random bits, one per optimizer; by default
            ``torch.initial_seed()`` (the seed of ``torch.manual_seed``: runs are repeatable, two optimizers built
            alike step alike, as ``torch.optim``'s do, and building one draws no random number). Saved in
            ``state_dict``.
        foreach (`bool`, *optional*): use the multi-tensor path (default: on CUDA tensors).
        maximize (`bool`, *optional*, defaults to `False`): maximize the objective.
        differentiable (`bool`, *optional*, defaults to `False`): ``True`` is refused (random signs have no
            useful derivative); accepted for ``torch.optim``'s keyword set.
        process_group (`ProcessGroup`, *optional*): run the 1-bit all-reduce in ``step()`` over this group.
        topology (`birder_hf.Topology`, *optional*): as ``process_group``, with a node topology.
        method (`str`, *optional*, defaults to `"hierarchical"`): the ``onebit_all_reduce`` method used with
            ``process_group``/``topology``.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Birder(model.parameters(), lr=1e-3, beta=0.95, weight_decay=0.1, seed=0)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()
    """

    settings = {
        "lr": LR,
        "beta": rule(lambda v: is_real_number(v) and 0 <= v < 1, "a float in [0, 1) (the paper uses 0.95)"),
        "weight_decay": NON_NEGATIVE,
        "quantize": FLAG,
        "amsgrad": FLAG,
        "beta2": rule(lambda v: v is None or (is_real_number(v) and 0 <= v < 1), "None or a float in [0, 1) (0.999)"),
        "eps": rule(lambda v: is_real_number(v) and v > 0, "a finite float > 0 (1e-8)"),
        "grad_clip": rule(lambda v: v is None or (is_real_number(v) and v > 0), "None or a finite float > 0 (1.0)"),
        "error_feedback": FLAG,
        "stale": rule(lambda v: v in STALE_MODES, f"one of {', '.join(map(repr, STALE_MODES))}"),
        "seed": INTEGER,
        "foreach": OPTIONAL_FLAG,
        "maximize": FLAG,
    }
    optional_settings = ("foreach", "maximize", "stale", "beta2", "eps", "grad_clip", "error_feedback")
    card_keys = ("lr", "beta", "weight_decay", "amsgrad", "stale", "beta2", "grad_clip", "error_feedback")
    card_name = "Birder (1-bit adaptive, Peng et al. NeurIPS 2023; birder-hf)"
    card_title = "## Trained with Birder"
    card_summary = (
        "This model was trained with [birder-hf](https://openreview.net/forum?id=Mlo2kM11ZB): the Birder "
        "optimizer exchanges 1-bit quantized update directions between workers (Hierarchical-1-bit-All-Reduce); "
        "what each method sends per step is in birder-hf's README."
    )
    state_keys = ("step", "exp_avg", "exp_avg_abs", "max_exp_avg_abs", "exp_avg_sq", "max_exp_avg_sq", "vote_error",
                  "shard")  # fmt: skip
    required_state = ("step", "exp_avg")  # and the second moment of the group's mode (_state_problem)
    tensor_state = ("exp_avg", "exp_avg_abs", "max_exp_avg_abs", "exp_avg_sq", "max_exp_avg_sq", "vote_error")

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        beta: float = 0.95,
        weight_decay: float = 0.0,
        *,
        quantize: bool = True,
        amsgrad: bool = False,
        beta2: float | None = None,
        eps: float = 1e-8,
        grad_clip: float | None = None,
        error_feedback: bool = False,
        stale: str | None = None,
        seed: int | None = None,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        process_group=None,
        topology=None,
        method: str | None = None,
        **unknown,
    ):
        stale = DEFAULT_STALE if stale is None else stale
        distributed = topology is not None or process_group is not None
        error = comm = None
        try:
            if unknown:  # a typo, or another optimizer's setting (timm and the Trainer pass them along): never ignored
                key = next(iter(unknown))
                hint = {"betas": "Birder has beta (m's EMA, 0.95) and, for the second-moment direction, beta2: pass "
                                 "beta=0.95 (and beta2=0.999)",
                        "lazy": 'it is stale= now: stale="lazy" (lazy=True) or stale="keep" (lazy=False)',
                        "comm_method": "it is method= now"}  # fmt: skip
                known = "its settings are lr, beta, weight_decay, quantize, amsgrad, beta2, eps, grad_clip, "
                known += "error_feedback, stale, seed, foreach, maximize"
                raise TypeError(f"Birder got an unknown setting {key}={unknown[key]!r}: {hint.get(key, known)}.")
            if differentiable is not False:
                what = f"Invalid differentiable={differentiable!r}: random signs have no useful derivative"
                raise ValueError(explain(what, "leave it False"))
            if process_group is not None and topology is not None:
                raise ValueError("Pass process_group= or topology=, not both.")
            if seed is None:  # torch's seed, not a draw from its generator: two optimizers built alike step alike
                seed = torch.initial_seed() % (2**31 - 1)
            seed = int(seed) if is_integer(seed) else seed  # a numpy int becomes a Python int (weights_only loads)
            defaults = {"lr": lr, "beta": beta, "weight_decay": weight_decay, "quantize": quantize, "amsgrad": amsgrad,
                        "beta2": beta2, "eps": eps, "grad_clip": grad_clip, "error_feedback": error_feedback,
                        "stale": stale, "seed": seed,
                        "foreach": foreach, "maximize": maximize}  # fmt: skip
            super().__init__(params, defaults)  # validates every setting and parameter
            if distributed and not quantize:
                raise ValueError("quantize=False sends full-precision u and is for one process only; drop it.")
            if not distributed and method is not None:
                what = "method= chooses the optimizer-side 1-bit all-reduce"
                raise ValueError(explain(what, "pass process_group= or topology= with it (DDP hook: BirderHookState)"))
            if distributed:
                comm = check_settings(DEFAULT_METHOD if method is None else method)
        except Exception as exc:
            if not distributed:
                raise
            error = exc
        if distributed:
            from .communicators import StepAllReduce  # the only way this module reaches torch.distributed

            # every rank of the group learns of this rank's error, or of settings that differ between the ranks,
            # and raises it too (none is left waiting in a collective), before the topology's groups are built
            StepAllReduce.agree_on_setup(self, comm, topology=topology, process_group=process_group, error=error)
            StepAllReduce(comm, topology=topology, process_group=process_group).attach(self)

    @property
    def seed(self) -> int:
        return int(self.param_groups[0]["seed"])

    def __setstate__(self, state):
        for group in state.get("param_groups", ()):  # saved before stale= replaced lazy=
            if "lazy" in group and "stale" not in group:
                group["stale"] = "lazy" if group.pop("lazy") else "keep"
        super().__setstate__(state)

    def card_settings(self) -> dict:
        return {**super().card_settings(), "seed": self.seed}

    def _check_group_keys(self, param_group: dict, where: str) -> None:
        if "lazy" in param_group:
            raise ValueError(f'lazy= in a param group{where} is replaced by stale= ("lazy", "fade" or "keep").')
        super()._check_group_keys(param_group, where)
        if "seed" in param_group and param_group["seed"] != self.defaults["seed"]:
            what = f"Invalid seed={param_group['seed']!r}{where}: Birder has one seed ({self.defaults['seed']!r})"
            raise ValueError(explain(what, "pass seed= to Birder, not to a group"))

    # --------------------------------------------------------------------- protocol for communicators
    def init_state(self, p: torch.Tensor, group: dict) -> dict:
        """The state of ``p`` (created on first use: zero ``m``, ``b`` at least float32, ``step`` 0).

        A sharded parameter (FSDP2's ``DTensor``) gets plain tensors of its local shard's shape, and ``"shard"``:
        ``(offset, local numel, full numel)``, which a resume checks (``birder_hf.base.shard_record``).
        """
        state = self.state[p]
        second, second_max = second_moment_keys(group)
        if len(state) == 0:
            dtype, x = state_dtype(p), local_tensor(p)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(x, dtype=dtype, memory_format=torch.preserve_format)
            state[second] = torch.zeros_like(x, dtype=dtype, memory_format=torch.preserve_format)
            record = shard_record(p)
            if record is not None:
                state["shard"] = record
        if group["amsgrad"] and second_max not in state:
            state[second_max] = state[second].clone()
        if group["error_feedback"] and "vote_error" not in state:
            state["vote_error"] = torch.zeros_like(state["exp_avg"])
        return state

    def encode(
        self,
        group: dict,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        *,
        out: EncodeOut | None = None,
        grad_scale: float = 1.0,
    ) -> list[torch.Tensor]:
        """Encode ``params`` of ``group`` and return ``u``.

        Without ``out``: count a step and update their ``m`` and ``b`` in place. With ``out``: leave the state alone
        and write the new ``m``, ``b`` (and ``u``) into ``out`` (staged: :meth:`commit_state` makes them the state).
        Callers check every parameter of the step with :meth:`check_state_matches` first. Sharded parameters and
        gradients (``DTensor``) are encoded on their local shards. ``grad_scale``: the loss scale ``grads`` carry
        (fp16 with a ``GradScaler``); the state gets ``grads / grad_scale``.
        """
        states = [self.init_state(p, group) for p in params]
        second, second_max = second_moment_keys(group)
        clip_norms = None
        if group["grad_clip"] is not None:  # each piece's share of the global norm: c sqrt(n_i / N)
            total = self.trained_numel()
            clip_norms = [group["grad_clip"] * math.sqrt(local_tensor(g).numel() / total) for g in grads]
        us = birder_encode(
            [local_tensor(g) for g in grads],
            [s["exp_avg"] for s in states],
            [s[second] for s in states],
            [s[second_max] for s in states] if group["amsgrad"] else None,
            beta=group["beta"],
            beta2=group["beta2"],
            eps=group["eps"],
            steps=[int(s["step"]) + 1 for s in states] if group["beta2"] is not None else None,  # bias corrections
            clip_norms=clip_norms,
            maximize=group["maximize"],
            foreach=group["foreach"],
            stale=group["stale"],
            out=out,
            grad_scale=grad_scale,
        )
        if group["error_feedback"]:  # errors staged with the rest (out.errors), or updated in place
            errors = [s["vote_error"] for s in states]
            vote_with_error_feedback(us, errors, out.errors if out is not None else errors)
        if out is None:  # counted once the math is done: a failure above leaves every counter as it was
            for s in states:
                s["step"] += 1
        return us

    def check_state_matches(self, params: list[torch.Tensor]) -> None:
        """As the base's, and each parameter's state holds its group's second moment (``b``, or ``v`` with ``beta2``):
        a group switched to the other mode over a live state is refused before anything is written."""
        super().check_state_matches(params)
        for p in params:
            state, group = self.state.get(p), self.group_of(p)
            second = second_moment_keys(group)[0] if group is not None else None
            if state and second is not None and second not in state:
                what = f"A parameter's state has no {second!r}, which beta2={group.get('beta2')!r} needs"
                raise ValueError(explain(what, "keep the beta2 the state was built with (set it back), or start over"))

    def trained_numel(self) -> int:
        """Elements of the parameters that take gradients (full sizes, sharded or not): ``grad_clip``'s :math:`N`."""
        return max(1, sum(p.numel() for g in self.param_groups for p in g["params"] if p.requires_grad))

    def _state_problem(self, p: torch.Tensor, state: dict, group: dict) -> str | None:
        problem = super()._state_problem(p, state, group)
        if problem is not None:
            return problem
        second, second_max = second_moment_keys(group)
        other = "exp_avg_abs" if second == "exp_avg_sq" else "exp_avg_sq"
        if second not in state or other in state or f"max_{other}" in state:
            mode = "beta2=None (u = m / b)" if second == "exp_avg_abs" else f"beta2={group['beta2']!r} (u from m, v)"
            saved = f" (it holds {other!r}: saved with the other beta2 mode)" if other in state else ""
            return f"lacks [{second!r}], which {mode} needs{saved}"
        m, b = state["exp_avg"], state[second]
        if second == "exp_avg_sq":
            if not bool((b >= 0).all()):
                return "has a negative exp_avg_sq"
        elif not bool((b >= m.abs()).all()):  # holds in floating point for every state Birder writes
            return "breaks |exp_avg| <= exp_avg_abs (then u = m / b would leave [-1, 1])"
        if second_max in state and not bool((state[second_max] >= b).all()):
            return f"breaks {second} <= {second_max}"
        if "vote_error" in state and not bool((state["vote_error"].abs() <= 1).all()):
            return "has a vote_error outside [-1, 1]"
        return None

    def commit_state(self, p: torch.Tensor, staged: StateBuffers) -> StateBuffers:
        """Make ``staged`` (``p``'s new ``m``, ``b``, max ``b``) its state and count the step.

        Returns the replaced buffers, for the caller to reuse. The DDP hook encodes into such buffers during
        backward and commits them once every rank agreed that the step is finite.
        """
        state = self.state[p]
        second, second_max = second_moment_keys(self.group_of(p))
        old = StateBuffers(state["exp_avg"], state[second], state.get(second_max), state.get("vote_error"))
        state["exp_avg"], state[second] = staged.exp_avg, staged.exp_avg_abs
        if staged.max_exp_avg_abs is not None:
            state[second_max] = staged.max_exp_avg_abs
        if staged.error is not None:
            state["vote_error"] = staged.error
        state["step"] += 1
        return old

    def bit_keys(self, params: list[torch.Tensor], steps: list[int]) -> BitKeys:
        """The keys of the random bits of ``params`` (flattened one after the other) at ``steps``.

        A sharded parameter contributes its local shard, its counters starting at the shard's offset in the full
        parameter (``birder_hf.base.shard_offset``): element ``j`` of a parameter draws from counter ``j`` whichever
        rank holds it, so the bits depend on the shard layout only through who draws them.
        """
        locals_ = [local_tensor(p) for p in params]
        return BitKeys(
            self.seed,
            steps,
            [self.param_index(p) for p in params],
            [x.numel() for x in locals_],
            [shard_offset(p) for p in params],
        )

    # ------------------------------------------------------------------------------------------- step
    def _step_alone(self) -> bool:
        updates = self._local_updates()
        self._step_communicated(updates)
        return updates is None

    def _step_communicated(self, updates: list[Update] | None) -> None:
        # None: a rank had a non-finite gradient, and every rank skips the step
        for group, params, directions in updates or ():
            birder_apply(
                [local_tensor(p) for p in params],
                [local_tensor(d) for d in directions],
                lr=group["lr"],
                weight_decay=group["weight_decay"],
            )

    def _local_updates(self) -> list[Update] | None:
        # one process: encode, then quantize locally (rank 0's keys; d = 0 where u == 0)
        batch = self.gradients()
        if not all_finite([g for gg in batch for g in gg.grads]):
            warnings.warn(
                "Birder: non-finite gradient; this step was skipped (state untouched).", RuntimeWarning, stacklevel=4
            )
            return None
        self.check_state_matches([p for gg in batch for p in gg.params])
        updates = []
        for group, params, grads in batch:
            us = self.encode(group, params, grads)
            if group["quantize"]:
                keys = self.bit_keys(params, [int(self.state[p]["step"]) for p in params])
                us = [_signs(u, keys.key(i, STAGE_WORKER, 0), keys.offsets[i]) for i, u in enumerate(us)]
            updates.append(Update(group, params, us))
        return updates


def _signs(u: torch.Tensor, key: tuple[int, int], offset: int = 0) -> torch.Tensor:
    # Q(u): +1 with probability (1 + u) / 2, else -1, in u's dtype and shape (offset: the counter of u's first
    # element); and 0 where u == 0 exactly: still unbiased, and a coordinate whose gradient has always been 0 stays
    # put (torch's convention), no fair coin
    q = torch.where(quantize_bits(u, key, offset).view_as(u), 1.0, -1.0).to(u.dtype)
    return q.masked_fill_(u == 0, 0.0)


class StateBuffers(NamedTuple):
    """One parameter's ``m``, ``b`` and max ``b`` (``None`` without amsgrad), with ``beta2`` ``v`` and max ``v`` in
    their places; and its vote error (``None`` without error feedback)."""

    exp_avg: torch.Tensor
    exp_avg_abs: torch.Tensor
    max_exp_avg_abs: torch.Tensor | None
    error: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------ functional
class EncodeOut(NamedTuple):
    """Where :func:`birder_encode` writes the new ``m``, ``b``, max ``b`` (``None`` without amsgrad) and ``u``; and
    :meth:`Birder.encode` the new vote errors (``None`` without error feedback)."""

    exp_avgs: list[torch.Tensor]
    exp_avg_abss: list[torch.Tensor]
    max_exp_avg_abss: list[torch.Tensor] | None
    us: list[torch.Tensor] | None
    errors: list[torch.Tensor] | None = None


def birder_encode(
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_abss: list[torch.Tensor],
    max_exp_avg_abss: list[torch.Tensor] | None = None,
    *,
    beta: float,
    beta2: float | None = None,
    eps: float = 1e-8,
    steps: list[int] | None = None,
    clip_norms: list[float] | None = None,
    maximize: bool = False,
    foreach: bool | None = None,
    stale: str = "keep",
    out: EncodeOut | None = None,
    grad_scale: float = 1.0,
) -> list[torch.Tensor]:
    r"""Birder's encoder: :math:`m \leftarrow \beta m + (1-\beta) g`, :math:`b \leftarrow \beta b + (1-\beta)|g|`
    (and :math:`\max b` with amsgrad); returns :math:`u = m / b` (0 where :math:`b = 0`), in ``[-1, 1]``. Where
    :math:`g = 0` exactly: ``stale="keep"`` (the paper) changes nothing, ``"fade"`` decays :math:`m` once more and
    sets :math:`u = 0` where :math:`|u| <` ``STALE_VOTE_MIN``, ``"lazy"`` sets :math:`u = 0` (see :class:`Birder`).

    Updates the state in place, or, with ``out``, leaves it alone and writes the new values into ``out``'s
    buffers (``out.us=None``: new tensors for ``u``). The single- and multi-tensor paths take the same arguments
    and give the same bits.

    ``grad_scale``: a loss scale ``S`` the gradients carry (fp16 loss scaling); ``m`` and ``b`` take ``g / S`` through
    the EMA's weight, ``(1 - beta) / S``, with no temporary. For a power of two ``S`` (``GradScaler``'s scales are)
    ``(1 - beta) / S`` is exact, and so the state is bit for bit that of the unscaled gradients ``g``.

    With ``beta2`` (see :class:`Birder`) ``exp_avg_abss`` hold :math:`v` (and ``max_exp_avg_abss`` its max), and
    ``steps`` (each tensor's step count, this step included) the bias corrections; ``u`` is
    :math:`\operatorname{clip}(\hat m / (\sqrt{\hat v} + \epsilon), -1, 1)`, one tensor at a time (``foreach`` has
    no effect). ``clip_norms[i]``: the norm ``grads[i] / S`` is scaled down to first, if it is above it.
    """
    if not (isinstance(grad_scale, (int, float)) and math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"grad_scale={grad_scale!r} must be a finite number > 0 (the loss scale of the gradients).")
    if stale not in STALE_MODES:
        raise ValueError(f"stale={stale!r} must be one of {', '.join(map(repr, STALE_MODES))}.")
    if clip_norms is not None:
        grads = [_clipped(g, bound, grad_scale) for g, bound in zip(grads, clip_norms)]
    if beta2 is not None:
        if steps is None or len(steps) != len(grads):
            raise ValueError("beta2= needs steps=: each tensor's step count, this step included (bias correction).")
        return _second_moment_encode(grads, exp_avgs, exp_avg_abss, max_exp_avg_abss, beta=beta, beta2=beta2,
                                     eps=eps, steps=steps, maximize=maximize, out=out, stale=stale,
                                     grad_scale=grad_scale)  # fmt: skip
    if foreach is None:
        foreach = bool(grads) and all(g.is_cuda for g in grads)
    fn = _multi_tensor_encode if foreach else _single_tensor_encode
    weight = (1 - beta) / grad_scale
    return fn(grads, exp_avgs, exp_avg_abss, max_exp_avg_abss, beta=beta, weight=weight, maximize=maximize, out=out,
              stale=stale)  # fmt: skip


def vote_with_error_feedback(us: list[torch.Tensor], errors: list[torch.Tensor], errors_out: list[torch.Tensor]):
    r"""Error feedback on the vote, in place: :math:`s = u + e`, ``u`` becomes :math:`\operatorname{sign}(s)` (+1 where
    :math:`s = 0`) and ``errors_out`` :math:`s - \operatorname{sign}(s)`; where ``u`` is 0 (no vote) it stays 0 and the
    error is kept. ``errors_out`` may be ``errors``. Every rank's ``u`` is then +1, -1 or 0, which the 1-bit vote
    sends as it is (:func:`birder_hf.quantize.quantize_bits` draws nothing for +-1)."""
    for u, e, e_out in zip(us, errors, errors_out):
        s = u.to(e.dtype) + e
        q = torch.where(s >= 0, 1.0, -1.0).to(e.dtype)
        vote = u != 0
        e_out.copy_(torch.where(vote, s - q, e))
        u.copy_(torch.where(vote, q, 0.0))


def _clipped(g: torch.Tensor, bound: float, grad_scale: float) -> torch.Tensor:
    """``g`` scaled so that ``||g|| / grad_scale <= bound`` (itself if it is already): a float32 or wider copy; the
    factor stays on ``g``'s device (no host sync)."""
    g = g.float() if g.dtype in (torch.float16, torch.bfloat16) else g
    norm = torch.linalg.vector_norm(g)
    factor = (bound * grad_scale / norm).clamp(max=1.0)  # inf where norm = 0: clamped to 1
    return g * factor


def birder_apply(params: list[torch.Tensor], directions: list[torch.Tensor], *, lr: float, weight_decay: float):
    r"""Birder's update :math:`x \leftarrow x - \eta (d + \lambda x)`, in place.

    Two in-place passes, no temporaries: :math:`x \leftarrow (1 - \eta\lambda) x - \eta d`; bf16/fp16
    parameters are updated in float32 and rounded once.
    """
    if isinstance(lr, torch.Tensor):
        return _apply_tensor_lr(params, directions, lr, weight_decay)
    decay = 1.0 - lr * weight_decay
    for p, d in zip(params, directions):
        x = p.float() if p.dtype in (torch.float16, torch.bfloat16) else p
        if decay != 1.0:
            x.mul_(decay)
        x.add_(d.to(x.dtype), alpha=-lr)
        if x is not p:
            p.copy_(x)


def _apply_tensor_lr(params, directions, lr: torch.Tensor, weight_decay: float) -> None:
    # a 1-element Tensor lr (a scheduler may change it in place): read on its device, never on the host
    rates: dict[tuple, torch.Tensor] = {}
    for p, d in zip(params, directions):
        x = p.float() if p.dtype in (torch.float16, torch.bfloat16) else p
        rate = rates.get((x.device, x.dtype))
        if rate is None:
            rate = rates[(x.device, x.dtype)] = lr.detach().reshape(()).to(device=x.device, dtype=x.dtype)
        if weight_decay != 0:
            x.mul_(1 - rate * weight_decay)
        x.addcmul_(d.to(x.dtype), rate, value=-1)
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
    stale: str = "keep",
    **encode_options,
) -> list[torch.Tensor]:
    r"""One-process Birder step (see :class:`Birder`): encode, :math:`d = Q(u)` (0 where :math:`u = 0`; or ``u``
    without ``quantize``), apply. ``keys[i]`` keys the random bits of ``params[i]``; ``encode_options``:
    :func:`birder_encode`'s ``beta2``, ``eps``, ``steps``, ``clip_norms``. Returns the directions :math:`d`."""
    us = birder_encode(
        grads,
        exp_avgs,
        exp_avg_abss,
        max_exp_avg_abss,
        beta=beta,
        maximize=maximize,
        foreach=foreach,
        stale=stale,
        **encode_options,
    )
    ds = [_signs(u, key) for u, key in zip(us, keys)] if quantize else us
    birder_apply(params, ds, lr=lr, weight_decay=weight_decay)
    return ds


def _encode_into(g, m, b, bmax, m_out, b_out, bmax_out, u_out, consts) -> None:
    """One tensor's encode, written into the ``*_out`` buffers (they may be ``m``, ``b``, ``bmax`` themselves;
    ``bmax`` and ``bmax_out`` are None without amsgrad).

    Every product is rounded before the sum (``m beta + g w``, no fused multiply-add), so that this function run
    eagerly and compiled into one pass (``torch.compile``; contraction is off on CPU) give the same bits; the
    reference (``birder_hf.reference``) computes the same. ``consts`` (:func:`_kernel_constants`): one tensor for the
    compiled kernel (one kernel serves every setting), a tuple of Python numbers eagerly (nothing to copy to a GPU;
    the eager kernels round a Python scalar to the tensor's dtype, so the bits are the same)."""
    beta, weight, sign, tiny, vote_min = consts[0], consts[1], consts[2], consts[3], consts[4]
    fade, lazy = consts[5] != 0, consts[6] != 0
    g = g.to(m.dtype) * sign
    m_new = m * beta + g * weight
    b_new = b * beta + g.abs() * weight
    zero = g == 0  # this step's stale coordinates
    m_new = torch.where(zero & fade, m_new * beta, m_new)  # fade: m decays once more, u shrinks by beta per step
    denom = b_new
    if bmax is not None:
        denom = torch.maximum(bmax, b_new)
        bmax_out.copy_(denom)
    # |m| <= b holds in floating point (monotone rounding); max(b, tiny) makes 0/0 = 0.
    u = (m_new / denom.clamp_min(tiny)).clamp(-1.0, 1.0)
    # no vote: lazy, every stale coordinate; fade, once faded below STALE_VOTE_MIN
    u = u.masked_fill(zero & (lazy | (fade & (u.abs() < vote_min))), 0.0)
    m_out.copy_(m_new)
    b_out.copy_(b_new)
    u_out.copy_(u)


# The compiled kernels: in place (the state is the output) or staged (other buffers), two graphs that are never called
# with the other's aliasing: torch 2.14's on-disk compile cache served a kernel compiled for an in-place call (it wrote
# m_new into m) to a staged call of the same graph (tests/test_optim.py runs both, in place first).
def _encode_staged(g, m, b, m_out, b_out, u_out, consts) -> None:
    _encode_into(g, m, b, None, m_out, b_out, None, u_out, consts)


def _encode_staged_amsgrad(g, m, b, bmax, m_out, b_out, bmax_out, u_out, consts) -> None:
    _encode_into(g, m, b, bmax, m_out, b_out, bmax_out, u_out, consts)


def _encode_in_place(g, m, b, u_out, consts) -> None:
    _encode_into(g, m, b, None, m, b, None, u_out, consts)


def _encode_in_place_amsgrad(g, m, b, bmax, u_out, consts) -> None:
    _encode_into(g, m, b, bmax, m, b, bmax, u_out, consts)


for _kernel in (_encode_staged, _encode_staged_amsgrad, _encode_in_place, _encode_in_place_amsgrad):
    register_kernel(_kernel.__name__, _kernel)


@functools.lru_cache(maxsize=64)
def _kernel_constants(values: tuple, dtype: torch.dtype) -> torch.Tensor:
    """:func:`_encode_into`'s constants for a compiled kernel: a read-only CPU tensor in the state's ``dtype`` (each
    value rounded as the eager kernels round a Python scalar) of beta, weight, the sign of g (-1 to maximize), the
    ``_TINY`` floor of b, ``STALE_VOTE_MIN``, and the stale mode as two 0/1 flags (fade, lazy)."""
    return torch.tensor([float(v) for v in values], dtype=dtype)


def _single_tensor_encode(grads, exp_avgs, exp_avg_abss, max_exp_avg_abss, *, beta, weight, maximize, out, stale):
    us = []
    values = (beta, weight, -1.0 if maximize else 1.0, _TINY, STALE_VOTE_MIN, stale == "fade", stale == "lazy")
    for i, (g, m, b) in enumerate(zip(grads, exp_avgs, exp_avg_abss)):
        m_out, b_out = (out.exp_avgs[i], out.exp_avg_abss[i]) if out is not None else (m, b)
        bmax = bmax_out = None
        if max_exp_avg_abss is not None:
            bmax = max_exp_avg_abss[i]
            bmax_out = out.max_exp_avg_abss[i] if out is not None else bmax
        u = out.us[i] if out is not None and out.us is not None else torch.empty_like(m_out)
        tensors = (g, m, b, bmax, m_out, b_out, bmax_out, u)
        if m.device.type == "cpu" and all(t is None or t.is_contiguous() for t in tensors):
            # one compiled pass over flat views (CPU: no contraction, so the same bits as eager)
            staged = out is not None
            name = "_encode_staged" if staged else "_encode_in_place"
            args = tensors if staged else (g, m, b, bmax, u)
            run_kernel(name + ("_amsgrad" if bmax is not None else ""), m.numel(),
                       *(t.view(-1) for t in args if t is not None), _kernel_constants(values, m.dtype))  # fmt: skip
        else:
            _encode_into(*tensors, values)
        us.append(u)
    return us


def _multi_tensor_encode(grads, exp_avgs, exp_avg_abss, max_exp_avg_abss, *, beta, weight, maximize, out, stale):
    if not grads:
        return []
    grads = [g.to(m.dtype) for g, m in zip(grads, exp_avgs)]
    if maximize:
        grads = torch._foreach_neg(grads)
    ms, bs, bmaxs = exp_avgs, exp_avg_abss, max_exp_avg_abss
    if out is not None:  # the same in-place arithmetic, on copies
        ms, bs, bmaxs = out.exp_avgs, out.exp_avg_abss, out.max_exp_avg_abss
        torch._foreach_copy_(ms, exp_avgs)
        torch._foreach_copy_(bs, exp_avg_abss)
        if max_exp_avg_abss is not None:
            torch._foreach_copy_(bmaxs, max_exp_avg_abss)
    # every product rounded before the sum, as _encode_into (no alpha=: that is a fused multiply-add); one temporary,
    # g w, then |g w| = |g| w (w > 0, and rounding is symmetric)
    torch._foreach_mul_(ms, beta)
    gw = torch._foreach_mul(grads, weight)
    torch._foreach_add_(ms, gw)
    torch._foreach_mul_(bs, beta)
    torch._foreach_abs_(gw)
    torch._foreach_add_(bs, gw)
    zeros = None if stale == "keep" else [g == 0 for g in grads]  # this step's stale coordinates
    if stale == "fade":  # m <- beta m where g == 0
        for m, zero in zip(ms, zeros):
            m.copy_(torch.where(zero, m * beta, m))
    denoms = bs
    if max_exp_avg_abss is not None:
        torch._foreach_maximum_(bmaxs, bs)
        denoms = bmaxs
    denoms = torch._foreach_clamp_min(denoms, _TINY)
    if out is not None and out.us is not None:
        us = out.us
        torch._foreach_copy_(us, ms)
        torch._foreach_div_(us, denoms)
    else:
        us = torch._foreach_div(ms, denoms)
    torch._foreach_clamp_min_(us, -1.0)
    torch._foreach_clamp_max_(us, 1.0)
    for u, zero in zip(us, zeros or ()):  # u <- 0 where a stale coordinate does not vote (see _encode_into)
        u.masked_fill_(zero & (u.abs() < STALE_VOTE_MIN) if stale == "fade" else zero, 0.0)
    return us


def _second_moment_encode(grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, *, beta, beta2, eps, steps, maximize, out,
                          stale, grad_scale):  # fmt: skip
    # beta2's direction, one tensor at a time, eagerly; every product rounded before the sum, as _encode_into
    us = []
    w1, w2 = (1 - beta) / grad_scale, (1 - beta2) / (grad_scale * grad_scale)
    for i, (g, m, v) in enumerate(zip(grads, exp_avgs, exp_avg_sqs)):
        m_out, v_out = (out.exp_avgs[i], out.exp_avg_abss[i]) if out is not None else (m, v)
        g = g.to(m.dtype)
        g = -g if maximize else g
        m_new = m * beta + g * w1
        v_new = v * beta2 + (g * g) * w2
        zero = g == 0  # this step's stale coordinates
        if stale == "fade":  # m decays once more: u shrinks by beta per stale step, beyond v's decay
            m_new = torch.where(zero, m_new * beta, m_new)
        denom = v_new
        if max_exp_avg_sqs is not None:
            denom = torch.maximum(max_exp_avg_sqs[i], v_new)
            (out.max_exp_avg_abss[i] if out is not None else max_exp_avg_sqs[i]).copy_(denom)
        t = steps[i]
        u = (m_new / (1 - beta**t)) / ((denom / (1 - beta2**t)).sqrt() + eps)
        u = u.clamp(-1.0, 1.0)
        if stale == "lazy":
            u = u.masked_fill(zero, 0.0)
        elif stale == "fade":
            u = u.masked_fill(zero & (u.abs() < STALE_VOTE_MIN), 0.0)
        m_out.copy_(m_new)
        v_out.copy_(v_new)
        if out is not None and out.us is not None:
            us.append(out.us[i].copy_(u))
        else:
            us.append(u)
    return us
