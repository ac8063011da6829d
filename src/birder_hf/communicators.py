"""Communicators: what turns every rank's encoded values into the synchronized direction.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB

- :class:`HookState`: the base of every hook state (DDP's :class:`birder_hf.BirderHookState` and
  :class:`birder_hf.OneBitAdamHookState`, FSDP's ``FSDPHookState``): the guards every hook needs (one hook per
  optimizer, parameters the optimizer owns, each parameter once per step), the staged records, the non-finite
  agreement, the per-step statistics; :class:`DDPBuckets`, the DDP hooks' component: the buckets DDP hands over.
- :class:`StepAllReduce`: Birder's optimizer-side 1-bit all-reduce, run inside ``optimizer.step()`` (training
  loops without DDP; sharded parameters).

The protocol between a communicator and its optimizer is in ``birder_hf.base``.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .base import Communicator, OneBitOptimizer, Update, all_finite, explain, local_tensor, state_dtype
from .collectives import CommStats, Job, Wire, check_agreement, launch_in_order, onebit_all_reduce
from .lifecycle import then
from .settings import CommSettings
from .together import raise_together
from .topology import Topology

__all__ = [
    "HookState",
    "DDPBuckets",
    "StepAllReduce",
    "UsageMarks",
    "max_over_ranks",
    "agree_setup",
    "setup_group",
    "setup_record",
]


def _nonfinite_flag(t: torch.Tensor) -> torch.Tensor:
    # min and max propagate NaN and hold +-inf: one reduction pass, no full-size temporary as in ~isfinite(t).all()
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=t.device)
    return ~torch.isfinite(torch.stack(torch.aminmax(t))).all()


def max_over_ranks(flags: torch.Tensor, group) -> torch.Tensor:
    """Element-wise maximum of ``flags`` (float64) over ``group`` (``None``: just this rank): any rank's 1 wins."""
    if group is not None:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags


# ------------------------------------------------------------------------------------------------ set-up
# One agreement path for every communicator (the DDP hooks, the FSDP hook, the optimizer-side all-reduce): each rank
# checks its own arguments, then the ranks exchange (one all-gather) their settings and any error they found, before
# the first other collective of the set-up (building a topology's groups), and every rank judges the same table. So a
# bad value on one rank stops every rank at once, with the same error, instead of leaving the others waiting in a
# collective until the process-group timeout; and ranks set up differently fail instead of drifting apart.


def setup_group(topology=None, process_group=None, agree_group=None):
    """The process group whose ranks agree on a communicator's set-up: ``agree_group``, else the topology's, else
    ``process_group``, else the default group; ``None`` where there is none to ask (torch.distributed not
    initialized, or an argument of the wrong kind: this rank then raises alone)."""
    if agree_group is not None:
        return agree_group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if topology is not None:
        return topology.world_group if isinstance(topology, Topology) and not topology.closed else None
    if process_group is not None:
        return process_group if isinstance(process_group, dist.ProcessGroup) else None
    return dist.group.WORLD


def setup_record(kind: str, optimizer, layout: tuple[int, int], **own) -> dict:
    """What every rank's communicator must share: its kind and own settings, the node layout, and the optimizer's
    parameter shapes and settings (but ``seed`` and ``foreach``, which change the result on no rank)."""
    out = {"communicator": kind, **own, "layout": tuple(layout)}
    out["parameters"] = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]]
    for i, group in enumerate(optimizer.param_groups):
        for key in optimizer.settings:
            if key not in ("seed", "foreach"):
                value = group[key]
                out[f"param group {i} {key}"] = float(value) if isinstance(value, torch.Tensor) else value
    return out


def agree_setup(
    group, record: dict | None, error: Exception | None = None, *, what: str, fix: str = "pass the same settings"
) -> None:
    """Agree a communicator's set-up with every rank of ``group``; raise on every rank, or on none.

    Collective (one ``all_gather_object``) over ``group``, which every member calls at the same point of its set-up,
    with its ``record`` (:func:`setup_record`) or the ``error`` its own checks raised. If a rank had an
    error, every rank raises it (:func:`birder_hf.together.raise_together`); if the records differ, every rank
    raises the same ``ValueError`` naming them. ``group`` ``None`` or of one rank: no exchange, just ``error`` (also
    where this rank is not a member of ``group``: nobody there waits for it).
    """
    rows = raise_together(error, group, record)
    if len(rows) == 1:
        return
    keys = list(dict.fromkeys(k for row in rows for k in row))
    differ = [k for k in keys if any(row.get(k) != rows[0].get(k) for row in rows)]
    if differ:
        shown = "; ".join(
            f"{k}: " + ", ".join(f"rank {r} {_shown(row.get(k))}" for r, row in enumerate(rows)) for k in differ[:4]
        )
        raise ValueError(explain(f"{what}: the ranks were set up differently ({shown})", f"{fix}; nothing was set up"))


def _shown(value) -> str:
    return value if isinstance(value, str) else repr(value)


class UsageMarks:
    """Which parameters got a gradient on this rank since the last step: the post-accumulate-grad hook of the tensor
    autograd accumulates into (the parameter itself; under FSDP2 its unsharded parameter) marks the parameter.

    A parameter that is not watched counts as used. The marks ride on a step's agreement all-reduce, so that a
    parameter no rank used is not stepped, also where the framework hands over zeros for it (DDP's buckets; FSDP2).
    """

    __slots__ = ("used", "watched", "handles")

    def __init__(self):
        self.used: set = set()
        self.watched: set = set()
        self.handles: list = []

    def watch(self, param: torch.Tensor, leaf: torch.Tensor | None = None) -> None:
        """Mark ``param`` used whenever autograd accumulates a gradient into ``leaf`` (default: ``param``)."""
        leaf = param if leaf is None else leaf
        if leaf.requires_grad:
            self.watched.add(param)
            self.handles.append(leaf.register_post_accumulate_grad_hook(lambda _t, p=param: self.used.add(p)))

    def is_used(self, p: torch.Tensor) -> bool:
        return p in self.used or p not in self.watched

    def clear(self) -> None:
        """Forget this step's marks (after the step, applied or skipped)."""
        self.used.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.watched = [], set()
        self.used.clear()


def poison_gradients(params) -> None:
    """Fill every gradient of ``params`` with NaN: a step every rank skips then looks non-finite to this rank's
    ``GradScaler`` too (it backs the scale off and skips ``step()``, as on the rank that overflowed)."""
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                local_tensor(p.grad).fill_(float("nan"))


def grad_scaler_scale(grad_scaler) -> float:
    """The loss scale ``grad_scaler`` multiplies the loss by now (1 without a scaler, or a disabled one)."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return 1.0
    return float(grad_scaler.get_scale())


def check_grad_scaler(grad_scaler) -> None:
    if isinstance(grad_scaler, type):  # the class has every method the checks below look for
        what = f"grad_scaler={grad_scaler.__name__} is a class"
        raise TypeError(explain(what, "pass the GradScaler instance that scales the loss (scaler = GradScaler(...))"))
    if grad_scaler is not None and not all(hasattr(grad_scaler, a) for a in ("get_scale", "is_enabled", "step")):
        raise TypeError(
            f"grad_scaler must be the torch.amp.GradScaler that scales the loss, got {type(grad_scaler).__name__}."
        )


class Staged(NamedTuple):
    """What a hook staged for one parameter until ``optimizer.step()``: its group, the optimizer's record and, where
    the hook keeps it (FSDP's), the direction ``step()`` applies (``None``: ``.grad``, where DDP writes ``d``)."""

    group: dict
    record: Any
    direction: torch.Tensor | None = None


class HookState(Communicator):
    """Base of every hook state: Birder's DDP hook (:class:`birder_hf.BirderHookState`), 1-bit Adam's
    (:class:`birder_hf.OneBitAdamHookState`) and Birder's FSDP hook (:class:`birder_hf.fsdp.FSDPHookState`).

    It owns what every hook does per step: the set-up agreement, the staged records (:meth:`group_to_stage`,
    :meth:`stage`; ``step()`` commits them), the ranks' agreement, the loss scale and the statistics. Its subclasses
    own where the gradients come from (a :class:`DDPBuckets`; FSDP's units) and turn :meth:`take_staged` into
    ``finish_step``.
    How the ranks agree on non-finite gradients and unused parameters, and fp16 loss scaling: ``docs/ARCHITECTURE.md``
    ("The contract", items 4 and 5, and the paragraph on ``HookState`` after it).

    Attributes:
        stats (`CommStats`): bytes this rank sent, all steps.
        last_step_stats (`CommStats`): the same for the last completed ``optimizer.step()``.
        steps_communicated (`int`): steps the hook communicated and the optimizer applied.
        skipped_steps (`int`): steps every rank skipped because a rank had a non-finite gradient.
    """

    optimizer_class: type = OneBitOptimizer
    hook_name = "the hook"
    loss_scale_invariant = True  # whether the hook may encode loss-scaled gradients (fp16 with a GradScaler)
    # skip a parameter no rank computed a gradient for, as a gradient of None does (see take_staged)
    skip_unused: bool = False
    wrapped_name = "the DDP model"  # what every parameter with a gradient must belong to (error messages)

    __slots__ = (
        # settings
        "optimizer",
        "topology",
        "_agree_group",  # None: the topology's world group (read through agree_group, so close() can release it)
        "check_finite",
        "comm_settings",  # the CommSettings of its 1-bit all-reduce (None: a hook without them, 1-bit Adam's)
        # per-step buffers
        "_pending",
        "_flags",
        "step_stats",
        "_verdict",
        "marks",  # the parameters that got a gradient on this rank since the last step (UsageMarks)
        "in_flight",  # exchanges the step waits for before its agreement and its end (the FSDP hook's)
        "_skipping",  # this step's agreed verdict was non-finite, and the step is dropped (a GradScaler skips it)
        # fp16 loss scaling
        "_grad_scaler",
        "_scale",  # the loss scale of this step's backward, read at its first bucket
        # statistics
        "stats",
        "last_step_stats",
        "steps_communicated",
        "skipped_steps",
    )

    def __init__(
        self,
        optimizer,
        topology: Topology | None = None,
        *,
        comm_settings: CommSettings | None = None,
        check_finite: bool = True,
        agree_group=None,
        grad_scaler=None,
        setup_error: Exception | None = None,
    ):
        # check_finite: checked in _check_setup (bool('no') is True, bool(None) False); comm_settings: the hook's 1-bit
        # all-reduce settings, built by the public entry point (None: 1-bit Adam's hook); setup_error: the entry
        # point's own failure (building them), raised on every rank by the agreement below
        self.check_finite, self.comm_settings = check_finite, comm_settings
        error = record = None  # this rank's checks, then one exchange with the others (agree_setup, "set-up" above)
        try:
            if setup_error is not None:
                raise setup_error
            self._check_setup(optimizer, topology)
            self.grad_scaler = grad_scaler  # the setter's checks, here on the ranks' agreement path
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(f"{self.hook_name} needs torch.distributed to be initialized (init_process_group).")
            nodes = (1, dist.get_world_size()) if topology is None else (topology.num_nodes, topology.local_world_size)
            own = {} if self.comm_settings is None else self.comm_settings.as_dict()
            record = setup_record(type(self).__name__, optimizer, nodes, check_finite=check_finite, **own)
            record["loss scaling"] = grad_scaler is not None and grad_scaler.is_enabled()
        except Exception as exc:
            error = exc
        agree_setup(
            setup_group(topology, agree_group=agree_group),
            record,
            error,
            what=type(self).__name__,
            fix=f"build every rank's hook state and {type(optimizer).__name__} with the same parameters and settings",
        )
        self._scale, self._skipping = None, False
        self.topology = topology if topology is not None else Topology.flat()
        # the ranks that agree a step is finite: the topology's (DDP), or every rank of the mesh (FSDP, whose
        # topology spans only this rank's replicas); None: the topology's, read through agree_group so close() frees it
        self._agree_group = agree_group
        self._pending: dict[torch.Tensor, Staged] = {}
        self._flags: list[torch.Tensor] = []
        self.in_flight: list[torch.futures.Future] = []
        # this backward's agreement, the ranks' element-wise maximum: [non-finite, then with skip_unused: used, per
        # parameter in the optimizer's order, then each param group's (lr, -lr, weight_decay, -weight_decay)]
        self._verdict: torch.Tensor | None = None
        self.stats, self.last_step_stats, self.step_stats = CommStats(), CommStats(), CommStats()
        self.steps_communicated = self.skipped_steps = 0
        self.marks = UsageMarks()
        self.attach(optimizer)

    def detach(self) -> None:
        self.marks.remove()
        super().detach()

    def _check_setup(self, optimizer, topology) -> None:
        """This rank's own checks of the set-up (before the ranks agree on it); subclasses add theirs."""
        name = type(self).__name__
        if not isinstance(self.check_finite, bool):  # never guess
            raise ValueError(f"Invalid check_finite={self.check_finite!r}: it must be True or False ({name}).")
        if not isinstance(optimizer, self.optimizer_class):
            raise TypeError(
                f"{name} needs a birder_hf.{self.optimizer_class.__name__} optimizer, got {type(optimizer).__name__}."
            )
        if optimizer.communicator is not None:
            what = f"This {type(optimizer).__name__} optimizer already has a hook state or a communicator"
            raise ValueError(explain(what, f"register {self.hook_name} once per model and optimizer"))
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a birder_hf.Topology, got {type(topology).__name__}.")
        if topology is not None:
            topology.check_open()
        if self.comm_settings is not None and not all(g.get("quantize", True) for g in optimizer.param_groups):
            raise ValueError("quantize=False is for one process only; the 1-bit hook always sends 1 bit.")

    @property
    def agree_group(self):
        """The ranks that agree a step is finite: the topology's (DDP), or every rank of the mesh (FSDP)."""
        return self.topology.world_group if self._agree_group is None else self._agree_group

    def metrics(self) -> dict[str, float]:
        """What an integration logs after a step: the bytes sent and the skipped steps, under the optimizer's
        ``metrics_prefix``."""
        prefix = self.optimizer.metrics_prefix
        return {**self.stats.as_dict(prefix), prefix + "skipped_steps": self.skipped_steps}

    @property
    def description(self) -> str:
        """What is registered, for logs (e.g. ``"1-bit hierarchical hook"``)."""
        return self.hook_name

    def __getstate__(self):
        fix = "save the optimizer (birder_hf.checkpoint.save_rank_state) and build a new hook state after loading"
        raise TypeError(explain(f"{type(self).__name__} holds process groups and is not saved", fix))

    def close(self) -> None:
        """Release what the hook holds, now: wait for its last exchange, drop a step that was not applied, detach from
        the optimizer and close the topology. Call it on every rank after the last ``optimizer.step()`` (the
        integrations do), before ``destroy_process_group()``. Statistics stay readable."""
        if self.topology.closed:
            return
        self._close_step()
        self.detach()
        self.topology.close()

    # ------------------------------------------------------------------------------------------ staging
    def begin_backward(self) -> None:
        """Called as each bucket (unit) of a backward begins: drops the state staged by a backward whose step was
        skipped without ``step()`` (a ``GradScaler`` skipped the call)."""
        self.topology.check_open()
        self._skipping = False
        if self._pending and self._bad_verdict():
            self._skip()  # nobody asked: step() was not called after the last backward's non-finite verdict

    def group_to_stage(self, p: torch.Tensor, what: str, fix_owner: str, fix_twice: str) -> dict:
        """``p``'s param group, before the hook encodes ``p`` (``what``: ``"A DDP parameter"``, ...): raises with
        ``fix_owner`` if the optimizer does not own ``p``, with ``fix_twice`` if ``p`` was staged this step already."""
        group = self.optimizer.group_of(p)
        if group is None:
            owner = type(self.optimizer).__name__
            raise RuntimeError(explain(f"{what} of shape {tuple(p.shape)} is not in the {owner} optimizer", fix_owner))
        if p in self._pending:
            raise RuntimeError(
                explain(f"{self.hook_name} saw the same parameter twice before optimizer.step()", fix_twice)
            )
        return group

    def stage(self, p: torch.Tensor, group: dict, record, direction: torch.Tensor | None = None) -> None:
        """Keep ``p``'s record (and direction) until ``step()`` (see :class:`Staged`)."""
        self._pending[p] = Staged(group, record, direction)

    def unstage(self, params: list[torch.Tensor]) -> None:
        """Forget what ``params`` staged, and the last finite flag (their bucket's hook failed): the next backward
        starts clean."""
        for p in params:
            self._pending.pop(p, None)
        if self.check_finite and self._flags:
            self._flags.pop()

    @property
    def grad_scaler(self):
        """The ``GradScaler`` whose scale the hook divides out of every gradient (``None``: no loss scaling)."""
        return self._grad_scaler

    @grad_scaler.setter
    def grad_scaler(self, grad_scaler) -> None:
        check_grad_scaler(grad_scaler)  # here, not as an AttributeError inside the next backward
        if grad_scaler is not None and not self.loss_scale_invariant:
            raise ValueError(explain(f"{self.hook_name} cannot train with fp16 loss scaling", "use bf16"))
        self._grad_scaler = grad_scaler

    def loss_scale(self) -> float:
        """The loss scale of this step's backward (``grad_scaler``'s, read once per backward; 1 without one): the hook
        encodes ``g / S``, so ``m`` and ``b`` stay in the gradient's unit whatever the scale does (S is a power of two:
        the division is exact)."""
        if self._scale is None:
            self._scale = grad_scaler_scale(self.grad_scaler)
        return self._scale

    # ---------------------------------------------------------------------------------------- agreement
    def flag_nonfinite(self, t: torch.Tensor) -> None:
        """Record (on ``t``'s device, no host sync) whether ``t`` holds a non-finite value; agreed later (an agreement
        made before is stale from now on)."""
        self._flags.append(_nonfinite_flag(t))
        self._verdict = None

    def _local_verdict(self, order: list[torch.Tensor]) -> torch.Tensor:
        # [this rank saw a non-finite value, then: this rank used it, per parameter of ``order``, then the settings
        # every rank must share (shared_settings)]; the ranks take the element-wise maximum
        if self._flags:
            bad = torch.stack(self._flags).any().to(torch.float64).reshape(1)
        else:
            bad = torch.zeros(1, dtype=torch.float64, device=next(iter(self._pending)).device)
        rest = [float(self.marks.is_used(p)) for p in order] + self.shared_settings()
        return torch.cat([bad, torch.tensor(rest, dtype=torch.float64).to(bad.device)])

    def _unused_order(self) -> list[torch.Tensor]:
        # the parameters whose use the ranks agree on: every staged one, in the optimizer's order (the same on
        # every rank: DDP's buckets hold every parameter)
        return sorted(self._pending, key=self.optimizer.param_index) if self.skip_unused else []

    def _bad_verdict(self) -> bool:
        return self._verdict is not None and self._verdict[0].item() != 0

    def queue_agreement(self, fut: torch.futures.Future) -> torch.futures.Future:
        """DDP's last bucket: ``fut``, its direction NaN on every rank if any rank had a non-finite value; the ranks'
        agreement is queued after ``fut``'s exchange (and every other call on the topology)."""
        flags = self._local_verdict(self._unused_order())
        self._verdict = flags  # the ranks' maximum, in place

        def start(wire):
            return wire.all_reduce_max(flags, "world")

        agreed = launch_in_order(self.topology, Job(Wire(self.topology, None), start, lambda wire, recv: recv))
        both = torch.futures.collect_all([fut, agreed])
        return then(both, lambda f: _nan_if(*(x.value() for x in f.value())))

    def _agreed_verdict(self) -> torch.Tensor | None:
        """This step's agreement (``None``: nothing staged, or ``check_finite=False``), made now if the backward did
        not make it (FSDP's hook agrees when asked, after its exchanges; DDP's after its last bucket)."""
        for fut in self.in_flight:  # the exchanges first, then the agreement (the same order on every rank)
            fut.wait()
        if self._verdict is None and self.check_finite and self._pending:
            self._verdict = max_over_ranks(self._local_verdict(self._unused_order()), self.agree_group)
        return self._verdict

    # -------------------------------------------------------------------------------------------- steps
    def amp_scaling(self) -> bool:
        """Whether ``step()`` takes ``.grad`` as it is from ``GradScaler``: yes, unless a rank's backward was
        non-finite (then the step is dropped and every rank's ``.grad`` is NaN: ``docs/ARCHITECTURE.md``, "The
        contract", item 5). Collective where the backward did not agree yet (FSDP): every rank asks once per step."""
        if self._skipping:
            return False
        verdict = self._agreed_verdict()
        if verdict is None or verdict[0].item() == 0:
            return True
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self._skip()
        self._skipping = True
        self.optimizer.step_was_skipped = True
        poison_gradients(params)
        return False

    def check_loss_scaled_step(self) -> None:
        """Called by ``step()`` when a ``GradScaler`` left ``.grad`` to the optimizer: refuse what would go wrong."""
        opt = self.optimizer
        if not self.loss_scale_invariant:
            raise RuntimeError(explain(f"{self.hook_name} cannot train with fp16 loss scaling", "use bf16 (or fp32)"))
        if not self.check_finite:
            what = f"{type(self).__name__}(check_finite=False) would apply a GradScaler's overflow steps"
            raise ValueError(explain(what, "keep check_finite=True"))
        scale = getattr(opt, "grad_scale", None)
        if scale is not None and self._pending and float(scale) != self.loss_scale():
            used, scaled = self.loss_scale(), float(scale)
            self._close_step()  # drop the step: the next backward starts clean
            what = f"{self.hook_name} encoded at loss scale {used:g}, but the GradScaler scaled the loss by {scaled:g}"
            raise RuntimeError(explain(what, "pass that GradScaler as the hook's grad_scaler=. Nothing was applied"))
        if scale is None:
            what = f"GradScaler.unscale_ (clip_grad_norm_ calls it) ran on {self.hook_name}'s direction in .grad"
            fix = "Do not unscale or clip with the 1-bit hook (a step is bounded by lr already)"
            raise RuntimeError(explain(what, fix))

    def check_plain_step(self) -> None:
        """Called by ``step()`` when no ``GradScaler`` called it: refuse a step whose gradients the hook divided by a
        loss scale, since nothing says the loss was scaled (``m`` and ``b`` would be stored at ``1/S`` of their
        values)."""
        if self._pending and self._scale not in (None, 1.0):
            scale = self._scale
            self._close_step()  # drop the step: the next backward starts clean
            what = f"{self.hook_name} divided this step's gradients by its GradScaler's scale {scale:g}, but step() "
            what += "was not called by that GradScaler"
            fix = "scale the loss with scaler.scale(loss) and step with scaler.step(optimizer), or give the hook no "
            fix += "grad_scaler (fp32, bf16). Nothing was applied"
            raise RuntimeError(explain(what, fix))

    def _close_step(self) -> dict[torch.Tensor, Staged]:
        # the end of a step, applied or not: hand over what was staged, forget its agreement, close its statistics
        for fut in self.in_flight:  # every exchange ends before anything else: the next step reuses the buffers
            fut.wait()
        pending, self._pending, self._flags, self.in_flight = self._pending, {}, [], []
        self._scale = self._verdict = None
        self.marks.clear()
        step_stats, self.step_stats = self.step_stats, CommStats()
        self.stats += step_stats
        self.last_step_stats = step_stats
        return pending

    def _skip(self) -> None:
        self._close_step()
        self.skipped_steps += 1
        message = f"{type(self.optimizer).__name__}: a rank had a non-finite gradient; every rank skipped the step."
        warnings.warn(message, RuntimeWarning, stacklevel=4)

    def take_staged(self) -> dict[torch.Tensor, Staged] | None:
        """What the hook staged this step (each subclass's ``finish_step`` turns it into what its optimizer applies),
        or ``None`` when a rank had a non-finite gradient (every rank skips); closes the step's statistics."""
        if self._skipping:  # amp_scaling dropped this step already (non-finite on a rank)
            self._skipping = False
            return None
        unused = []
        if self.check_finite and self._pending:
            order = self._unused_order()
            # not through DDP's last bucket (FSDP, or step() mid-backward): agreed now
            agreed = self._agreed_verdict().tolist()
            if agreed[0] != 0:
                self._skip()
                return None
            try:
                self.check_shared_settings(agreed[1 + len(order) :])
            except RuntimeError:
                self._close_step()  # dropped on every rank: the next backward starts clean
                raise
            unused = [p for p, used in zip(order, agreed[1:]) if used == 0]
        pending = self._close_step()
        unseen = [
            p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None and p not in pending
        ]
        if unseen:
            p = unseen[0]
            what = f"A parameter of shape {tuple(p.shape)} has a gradient but {self.hook_name} did not see it"
            fix = f"optimize only parameters of {self.wrapped_name} the hook is registered on"
            without = sum(q.grad is None for g in self.optimizer.param_groups for q in g["params"])
            if without and self.wrapped_name == "the DDP model":  # the likelier cause: DDP held the bucket back
                what += f", and {without} parameter(s) had no gradient in this backward: DDP with "
                what += "find_unused_parameters=False never hands a bucket that holds an unused parameter to the hook"
                fix = "pass find_unused_parameters=True (TrainingArguments(ddp_find_unused_parameters=True), "
                fix += "accelerate's DistributedDataParallelKwargs), or leave the unused layers out of the model"
            raise RuntimeError(explain(what, fix + ". Nothing was applied"))
        for p in unused:  # no rank computed a gradient for it: no step, as for a gradient of None
            del pending[p]
        if pending:
            self.steps_communicated += 1
        return pending


class BucketGrad(NamedTuple):
    """One parameter of a DDP bucket, as the hooks see it (:meth:`DDPBuckets.begin`)."""

    param: torch.Tensor
    grad: torch.Tensor  # the bucket's view of its gradient, in the order DDP filled it
    group: dict  # its param group
    offset: int  # its first element in the bucket
    in_place: torch.Tensor  # the view DDP reads it back through when the hook returns the bucket itself


class DDPBuckets:
    """DDP's side of a hook state (one each for :class:`birder_hf.BirderHookState` and
    :class:`birder_hf.OneBitAdamHookState`): where each gradient lies in the bucket DDP hands over, the guards, and
    the agreement queued after the last bucket: a hook calls :meth:`begin`, starts its exchange, and returns
    :meth:`finish` (on a failure it unstages the bucket). With ``skip_unused``, every parameter is watched
    (:class:`UsageMarks`): DDP hands the hook zeros for an unused one.
    """

    __slots__ = ("state", "_layouts")

    def __init__(self, state: HookState):
        self.state = state
        self._layouts: dict[torch.Tensor, tuple] = {}  # param -> (where, filled strided, read back through .grad)
        if state.skip_unused and state.check_finite:
            self._watch([p for g in state.optimizer.param_groups for p in g["params"]])

    def _watch(self, params) -> list[torch.Tensor]:
        new = [p for p in params if p not in self.state.marks.watched]
        for p in new:
            self.state.marks.watch(p)
        return new

    def finish(self, bucket, fut: torch.futures.Future) -> torch.futures.Future:
        """What the hook hands DDP for ``bucket``: ``fut`` (the bucket's exchange), and after the last bucket the
        ranks' agreement queued behind it (:meth:`HookState.queue_agreement`)."""
        return self.state.queue_agreement(fut) if self.state.check_finite and bucket.is_last() else fut

    def begin(self, bucket) -> list[BucketGrad]:
        """The bucket's parameters with their gradients and groups, checked (:class:`BucketGrad`); counts the bucket's
        finite flag. Drops the state staged by a backward whose step a ``GradScaler`` skipped."""
        state = self.state
        state.begin_backward()
        buffer = bucket.buffer()
        items, offset = [], 0
        for p in bucket.parameters():
            group = state.group_to_stage(
                p,
                "A DDP parameter",
                "build the optimizer from every parameter that gets gradients",
                "accumulate in model.no_sync() (or accelerator.accumulate) on all but the last micro-batch",
            )
            items.append(self._grad(bucket.index(), buffer, p, group, offset))
            offset += p.numel()
        if state.check_finite:
            state.flag_nonfinite(buffer)
            if state.skip_unused:  # a parameter added since: watched from now on, counted as used this step
                state.marks.used.update(self._watch([b.param for b in items]))
        return items

    def _grad(self, bucket_index: int, buffer: torch.Tensor, p: torch.Tensor, group: dict, offset: int) -> BucketGrad:
        """Where ``p``'s gradient lies in the bucket, and where DDP reads a result the hook writes into the bucket.

        DDP fills a dense parameter's segment in the memory order the parameter had when DDP built its buckets
        (``Reducer::initialize_bucket_views``) and reads the result back with its current strides
        (``populate_bucket_views_out``); the two differ for a model converted to channels_last after wrapping
        (``docs/SETUPS.md``, channels_last). For a parameter that is not C-contiguous, the fill order is read off
        ``p.grad`` the first time it is seen here: DDP's fill view under ``gradient_as_bucket_view=True``, otherwise
        equal to one of the two readings of the bucket (a gradient that reads the same both ways is asked again).
        """
        plain = buffer[offset : offset + p.numel()].view(p.shape)
        if p.is_contiguous() or not is_dense(p):
            return BucketGrad(p, plain, group, offset, plain)
        strided = buffer.as_strided(p.shape, p.stride(), buffer.storage_offset() + offset)
        where = (bucket_index, offset, p.stride())
        known = self._layouts.get(p)
        if known is None or known[0] != where:
            g, decided, fill_strided, through_grad = p.grad, False, True, False
            if g is not None and g.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                decided, fill_strided, through_grad = True, g.stride() == p.stride(), True
            elif g is not None:
                same_strided, same_plain = torch.equal(strided, g), torch.equal(plain, g)
                decided, fill_strided = same_strided != same_plain, same_strided or not same_plain
            known = (where, fill_strided, through_grad)
            if decided:
                self._layouts[p] = known
        _, fill_strided, through_grad = known
        fill = strided if fill_strided else plain
        return BucketGrad(p, fill, group, offset, fill if through_grad else strided)


def _nan_if(d: torch.Tensor, verdict: torch.Tensor) -> torch.Tensor:
    # a rank had a non-finite gradient: d is NaN everywhere, as an fp32 all-reduce would have made it
    return d.fill_(float("nan")) if verdict[0].item() != 0 else d


def _grad_versions(params) -> tuple:
    # which gradient tensors the parameters hold, and their in-place version counters
    return tuple((id(p.grad), local_tensor(p.grad)._version) for p in params if p.grad is not None)


def is_dense(t: torch.Tensor) -> bool:
    # its elements fill numel() consecutive slots in some order of the dimensions (no gaps, no overlap)
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class StepAllReduce(Communicator):
    """Birder's optimizer-side 1-bit all-reduce: ``step()`` encodes, all-reduces ``u`` and applies ``d``.

    For training loops without DDP and for sharded parameters. Every rank takes part in the same collectives: one
    small all-reduce agrees on the parameters with a gradient on any rank (a rank without one contributes ``g = 0``)
    and on non-finite ones; then one ``onebit_all_reduce`` of the concatenated ``u`` of those parameters.

    Args:
        settings (`CommSettings`): the ``onebit_all_reduce`` settings (what :meth:`agree_on_setup` returns).
        topology (`Topology`, *optional*): the ranks and their nodes; default ``Topology.flat(process_group)``.
        process_group (`ProcessGroup`, *optional*): the ranks, when no ``topology`` is given.
        agree_group (`ProcessGroup`, *optional*): the ranks that agree on skipped steps and used parameters (default:
            the topology's); sharded parameters need every rank of the mesh (``birder_hf.fsdp`` passes it).
        usage (`UsageMarks`, *optional*): which parameters this rank used (``birder_hf.fsdp`` watches FSDP's unsharded
            parameters): a parameter no rank used is not stepped even where ``.grad`` holds zeros for it. Without it,
            a parameter counts as used where ``.grad`` is not None.

    Sharded parameters (FSDP2's ``DTensor``) are encoded, all-reduced and updated on their local shards.

    fp16 loss scaling: ``docs/ARCHITECTURE.md``, "The contract", item 5 (the agreement runs when the scaler asks
    ``_step_supports_amp_scaling``; a valid step encodes ``g / S``, so ``m`` and ``b`` are those of the unscaled run).
    """

    def __init__(
        self,
        settings: CommSettings,
        *,
        topology: Topology | None = None,
        process_group=None,
        agree_group=None,
        usage: UsageMarks | None = None,
    ):
        if not isinstance(settings, CommSettings):
            raise TypeError(f"settings must be a CommSettings (agree_on_setup returns it), got {settings!r}")
        self.comm_settings = settings
        if topology is None:
            topology = Topology.flat(process_group)
        elif not isinstance(topology, Topology):
            raise TypeError(f"topology must be a birder_hf.Topology, got {type(topology).__name__}.")
        self.topology = topology
        self._agree_group = agree_group  # None: the topology's world group (not held here: the exit handler frees it)
        self.usage = usage
        self.stats = CommStats()
        self._verdict: torch.Tensor | None = None  # agreed when a GradScaler asked, for the step() it calls next
        self._poisoned: tuple | None = None  # the gradients amp_scaling filled with NaN (a skipped step)
        self._compare_gradients = True  # at the first step: gradients the same on every rank mean DDP averaged them

    def detach(self) -> None:
        if self.usage is not None:
            self.usage.remove()
        super().detach()

    def _step_verdict(self) -> torch.Tensor:
        # one all-reduce: [non-finite on any rank, then: used (has a gradient) on any rank, per parameter]
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        grads = {p: p.grad for gg in opt.gradients() for p in gg.params}
        # ... then the settings every rank must share (shared_settings)
        usage = self.usage
        used = [float(p in grads and (usage is None or usage.is_used(p))) for p in params]
        finite = all_finite(list(grads.values()))
        flags = torch.tensor([0.0 if finite else 1.0, *used, *self.shared_settings()], dtype=torch.float64)
        if self._compare_gradients:  # and a fingerprint of this rank's gradients, as (x, -x)
            x = sum(float(local_tensor(g).double().sum()) for g in grads.values())
            flags = torch.cat([flags, torch.tensor([x, -x], dtype=torch.float64)])
        dev = params[0].device if params else torch.device("cpu")
        return max_over_ranks(flags.to(dev), self.agree_group).cpu()

    def _skip(self) -> None:
        if self.usage is not None:
            self.usage.clear()
        warnings.warn(
            "Birder: a rank had a non-finite gradient; every rank skipped this step.", RuntimeWarning, stacklevel=5
        )

    @staticmethod
    def agree_on_setup(
        optimizer,
        comm: CommSettings | None,
        *,
        topology: Topology | None = None,
        process_group=None,
        agree_group=None,
        error: Exception | None = None,
        what: str = "Birder(process_group=...)",
    ) -> CommSettings:
        """Agree, with every rank, on ``comm`` (built by the entry point: ``None`` only with an ``error``) and the
        optimizer of the ``StepAllReduce`` about to be built for ``optimizer`` (:func:`agree_setup`), or on ``error``,
        this rank's own failure, which every rank then raises. Collective over :func:`setup_group`; call it before
        building the topology. Returns ``comm``, to build it with."""
        record = None
        if error is None:
            try:
                if not isinstance(comm, CommSettings):
                    raise TypeError(f"comm must be a CommSettings (check_settings builds it), got {comm!r}")
                if topology is not None:
                    if not isinstance(topology, Topology):
                        raise TypeError(f"topology must be a birder_hf.Topology, got {type(topology).__name__}.")
                    topology.check_open()
                    layout = (topology.num_nodes, topology.local_world_size)
                else:
                    if process_group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", object()):
                        fix = "pass process_group= only on the group's ranks"
                        raise ValueError(explain("This process is not a member of process_group", fix))
                    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
                        what = f"process_group is a {type(process_group).__name__}"
                        raise TypeError(explain(what, "pass a torch.distributed ProcessGroup (e.g. dist.group.WORLD)"))
                    layout = (1, dist.get_world_size(process_group))
                record = setup_record("StepAllReduce", optimizer, layout, **comm.as_dict())
            except Exception as exc:
                error = exc
        agree_setup(
            setup_group(topology, process_group, agree_group),
            record,
            error,
            what=what,
            fix=f"build every rank's {type(optimizer).__name__} with the same parameters and settings",
        )
        return comm

    @property
    def agree_group(self):
        """The ranks that agree on skipped steps and used parameters."""
        return self.topology.world_group if self._agree_group is None else self._agree_group

    def amp_scaling(self) -> bool:
        """Asked by ``GradScaler.step`` on every rank: agree now (see the class docstring). ``True``: the scaler calls
        ``step()`` with the scaled gradients and their scale; ``False``: a rank overflowed, every rank's ``.grad`` is
        NaN and every rank's scaler skips ``step()``."""
        flags = self._step_verdict()
        if flags[0] == 0:
            self._verdict = flags
            return True
        self._verdict = None
        self._skip()
        self.optimizer.step_was_skipped = True
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        poison_gradients(params)
        # a rank whose scaler un-scaled before this agreement (scaler.unscale_ for clipping) may still call step():
        # it skips without a collective while .grad is the one poisoned here
        self._poisoned = _grad_versions(params)
        return False

    def finish_step(self) -> list[Update] | None:
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        grads = {p: p.grad for gg in opt.gradients() for p in gg.params}
        poisoned, self._poisoned = self._poisoned, None
        if poisoned is not None and poisoned == _grad_versions(params):
            return None  # amp_scaling agreed to skip this step, and another rank's scaler skips step()
        scaled = hasattr(opt, "found_inf")  # a GradScaler asked amp_scaling just before calling step()
        flags = self._verdict if scaled and self._verdict is not None else self._step_verdict()
        self._verdict = None
        if flags[0] != 0:
            self._skip()
            return None
        if self.usage is not None:
            self.usage.clear()
        shared = flags[1 + len(params) :].tolist()
        if self._compare_gradients:
            self._compare_gradients = False
            shared, (high, low) = shared[:-2], shared[-2:]
            if high == -low != 0 and self.topology.world_size > 1:
                what = "Birder(process_group=...) got the same gradients on every rank at its first step: a DDP model "
                what += "without the Birder hook? DDP all-reduced them in fp32 already, and step() exchanges them "
                what += "again at 1 bit, every step"
                fix = "register the hook (attach_ddp_hook, register_birder_hook or BirderTrainer) and build Birder "
                fix += "without process_group=, or train the model without the DDP wrapper"
                warnings.warn(explain(what, fix), UserWarning, stacklevel=4)
        self.check_shared_settings(shared)
        scale = getattr(opt, "grad_scale", None) if scaled else None  # None: un-scaled already (scaler.unscale_)
        scale = 1.0 if scale is None else float(scale)
        used = {p for p, f in zip(params, flags[1:].tolist()) if f}
        batch = [(g, [p for p in g["params"] if p in used]) for g in opt.param_groups]
        batch = [(g, ps) for g, ps in batch if ps]
        if not batch:
            return []
        ordered = [p for _, ps in batch for p in ps]
        dev = ordered[0].device
        # before any state changes: the parameters still match their state, and every rank makes the same call
        # (one all-gather the first time this set of parameters is used; a cache lookup afterwards)
        opt.check_state_matches(ordered)
        dtype = ordered[0].new_empty(0, dtype=state_dtype(ordered[0])).dtype
        for p in ordered[1:]:
            dtype = torch.promote_types(dtype, state_dtype(p))
        check_agreement(
            sum(local_tensor(p).numel() for p in ordered),
            topology=self.topology,
            method=self.comm_settings,
            dtype=dtype,
            device=dev,
        )
        us = []
        for group, ps in batch:
            gs = [grads[p] if p in grads else torch.zeros_like(local_tensor(p)) for p in ps]
            us += opt.encode(group, ps, gs, grad_scale=scale)
        keys = opt.bit_keys(ordered, [int(opt.state[p]["step"]) for p in ordered])
        flat = torch.cat([u.reshape(-1) for u in us])
        d = onebit_all_reduce(
            flat,
            topology=self.topology,
            method=self.comm_settings,
            keys=keys,
            stats=self.stats,
            out=flat,
        )
        updates, offset = [], 0
        for group, ps in batch:
            ds = []
            for p in ps:
                x = local_tensor(p)
                ds.append(d[offset : offset + x.numel()].view_as(x))
                offset += x.numel()
            updates.append(Update(group, ps, ds))
        return updates
