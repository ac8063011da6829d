"""Communicators: what turns every rank's encoded values into the synchronized direction.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB

- :class:`HookState`: the base of the DDP communication hooks' states (:class:`birder_hf.BirderHookState`,
  :class:`birder_hf.OneBitAdamHookState`): the guards every hook needs (one hook per optimizer, parameters the
  optimizer owns, each parameter once per step), the non-finite agreement, the per-step statistics.
- :class:`StepAllReduce`: Birder's optimizer-side 1-bit all-reduce, run inside ``optimizer.step()`` (training
  loops without DDP; sharded parameters).

The protocol between a communicator and its optimizer is in ``birder_hf.base``.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from .base import Communicator, OneBitOptimizer, Update, all_finite, local_tensor, state_dtype
from .collectives import (
    DEFAULT_INTER_METHOD,
    DEFAULT_METHOD,
    CommStats,
    check_agreement,
    check_settings,
    onebit_all_reduce,
)
from .topology import Topology

__all__ = ["HookState", "StepAllReduce", "agree"]


def _nonfinite_flag(t: torch.Tensor) -> torch.Tensor:
    # min and max propagate NaN and hold +-inf: one reduction pass, no full-size temporary as in ~isfinite(t).all()
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=t.device)
    return ~torch.isfinite(torch.stack(torch.aminmax(t))).all()


def agree(flags: torch.Tensor, group) -> torch.Tensor:
    """Element-wise maximum of ``flags`` (float32) over ``group`` (``None``: just this rank): any rank's 1 wins."""
    if group is not None:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags


class Staged(NamedTuple):
    """What a hook staged for one parameter until ``optimizer.step()``: its group and the optimizer's record."""

    group: dict
    record: Any


class HookState(Communicator):
    """Base of the DDP communication hooks' states (see the module docstring).

    Subclasses set ``optimizer_class`` and ``hook_name``, call :meth:`_begin_bucket` in the hook, and consume
    :meth:`finish_step`'s result in their optimizer's ``step()``.

    Attributes:
        stats (`CommStats`): bytes this rank sent, all steps.
        last_step_stats (`CommStats`): the same for the last completed ``optimizer.step()``.
        steps_communicated (`int`): steps the hook communicated and the optimizer applied.
        skipped_steps (`int`): steps every rank skipped because a rank had a non-finite gradient.
    """

    optimizer_class: type = OneBitOptimizer
    hook_name = "the hook"
    # skip a parameter no rank computed a gradient for, as a gradient of None does (see finish_step)
    skip_unused: bool = False
    wrapped_name = "the DDP model"  # what every parameter with a gradient must belong to (error messages)

    __slots__ = (
        # settings
        "optimizer",
        "topology",
        "agree_group",
        "check_finite",
        # per-step buffers
        "_pending",
        "_flags",
        "_step_stats",
        "_used",  # parameters that got a gradient since the last step (their post-accumulate-grad hook ran)
        "_watched",  # parameters with that hook, and its handles
        "_handles",
        # statistics
        "stats",
        "last_step_stats",
        "steps_communicated",
        "skipped_steps",
    )

    def __init__(self, optimizer, topology: Topology | None = None, *, check_finite: bool = True, agree_group=None):
        name = type(self).__name__
        if not isinstance(optimizer, self.optimizer_class):
            raise TypeError(
                f"{name} needs a birder_hf.{self.optimizer_class.__name__} optimizer, got {type(optimizer).__name__}."
            )
        if optimizer.communicator is not None:
            raise ValueError(
                f"This {type(optimizer).__name__} optimizer already has a hook state (the hook was registered before) "
                f"or a communicator; register {self.hook_name} once per model and optimizer."
            )
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a birder_hf.Topology, got {type(topology).__name__}.")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{self.hook_name} needs torch.distributed to be initialized (init_process_group).")
        self.topology = topology if topology is not None else Topology.flat()
        # the ranks that agree a step is finite: the topology's (DDP), or every rank of the mesh (FSDP, whose
        # topology spans only this rank's replicas)
        self.agree_group = self.topology.world_group if agree_group is None else agree_group
        self.check_finite = bool(check_finite)
        self._pending: dict[torch.Tensor, Staged] = {}
        self._flags: list[torch.Tensor] = []
        self.stats, self.last_step_stats, self._step_stats = CommStats(), CommStats(), CommStats()
        self.steps_communicated = self.skipped_steps = 0
        self._used, self._watched, self._handles = set(), set(), []
        self._agree_settings(optimizer)
        self.attach(optimizer)
        if self.skip_unused and self.check_finite:
            self._watch([p for g in optimizer.param_groups for p in g["params"]])

    def _watch(self, params) -> None:
        # one Python call per parameter per backward: how a rank knows which parameters it used this step (DDP
        # hands the hook zeros for an unused one, and with zero_grad(set_to_none=False) its .grad is a zero tensor)
        for p in params:
            if p.requires_grad and p not in self._watched:
                self._watched.add(p)
                self._handles.append(p.register_post_accumulate_grad_hook(self._used.add))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._watched = [], set()
        super().detach()

    def _settings(self, optimizer) -> dict:
        """What every rank's hook state must share: its own settings, the layout, the optimizer's settings."""
        out = {"hook": type(self).__name__, "check_finite": self.check_finite}
        out["layout"] = (self.topology.num_nodes, self.topology.local_world_size)
        out["parameters"] = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]]
        for i, group in enumerate(optimizer.param_groups):
            for key in optimizer.settings:
                if key not in ("seed", "foreach"):  # neither changes the result on any rank
                    value = group[key]
                    out[f"param group {i} {key}"] = float(value) if isinstance(value, torch.Tensor) else value
        return out

    def _agree_settings(self, optimizer) -> None:
        # Collective: one all-gather when the hook state is built, so that ranks set up differently (a method, a
        # learning rate, check_finite) fail here, together, instead of hanging or drifting apart during training.
        topo = self.topology
        if topo.world_size == 1:
            return
        mine = self._settings(optimizer)
        table: list = [None] * topo.world_size
        dist.all_gather_object(table, mine, group=topo.world_group)
        keys = list(dict.fromkeys(k for row in table for k in row))
        differ = [k for k in keys if any(row.get(k) != table[0].get(k) for row in table)]
        if differ:
            shown = "; ".join(
                f"{k}: " + ", ".join(f"rank {r} {row.get(k)!r}" for r, row in enumerate(table)) for k in differ[:4]
            )
            raise ValueError(
                f"{type(self).__name__}: the ranks were set up differently ({shown}). Every rank must build its hook "
                f"state with the same settings, and its {type(optimizer).__name__} with the same parameters and "
                "settings (the replicas would drift apart, or the ranks' collectives would not match)."
            )

    def _abort_bucket(self, params: list[torch.Tensor]) -> None:
        """Forget what the current bucket staged (its hook failed): the next backward starts clean."""
        for p in params:
            self._pending.pop(p, None)
        if self.check_finite and self._flags:
            self._flags.pop()  # the bucket's flag: the last one _begin_bucket appended

    @property
    def description(self) -> str:
        """What is registered, for logs (e.g. ``"1-bit hierarchical hook"``)."""
        return self.hook_name

    def __getstate__(self):
        raise TypeError(
            f"{type(self).__name__} holds process groups and is not saved; save the optimizer with "
            "birder_hf.checkpoint.save_rank_state and create a new hook state after loading."
        )

    def _begin_bucket(self, bucket) -> list[tuple[torch.Tensor, torch.Tensor, dict]]:
        """The bucket's ``(parameter, gradient, group)``, checked; counts its fp32 baseline and its finite flag."""
        opt, buffer = self.optimizer, bucket.buffer()
        items = []
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            group = opt.group_of(p)
            if group is None:
                raise RuntimeError(
                    f"A DDP parameter of shape {tuple(p.shape)} is not in the {type(opt).__name__} optimizer; every "
                    f"parameter that gets gradients must be optimized by the {type(opt).__name__} instance the hook "
                    "state was built with."
                )
            if p in self._pending:
                raise RuntimeError(
                    f"{self.hook_name} saw the same parameter twice before optimizer.step(): for gradient "
                    "accumulation wrap the micro-batches before the last in model.no_sync() (or use "
                    "accelerator.accumulate)."
                )
            items.append((p, g, group))
        if self.check_finite:
            self._flag_nonfinite(buffer)
            if self.skip_unused:  # a parameter added since: watched from now on, counted as used this step
                new = [p for p, _, _ in items if p not in self._watched]
                self._watch(new)
                self._used.update(new)
        return items

    def _flag_nonfinite(self, t: torch.Tensor) -> None:
        """Record (on ``t``'s device, no host sync) whether ``t`` holds a non-finite value; agreed at ``step()``."""
        self._flags.append(_nonfinite_flag(t))

    def _stage(self, p: torch.Tensor, group: dict, record) -> None:
        self._pending[p] = Staged(group, record)

    def finish_step(self) -> dict[torch.Tensor, Staged] | None:
        """Called by ``optimizer.step()``: agree with every rank that the step is finite, close its statistics and
        hand over what the hook staged (``None``: a rank had a non-finite gradient and every rank skips)."""
        pending, flags, used = self._pending, self._flags, set(self._used)
        self._pending, self._flags = {}, []
        self._used.clear()  # the same set: the parameters' hooks add to it
        step_stats, self._step_stats = self._step_stats, CommStats()
        self.stats += step_stats
        self.last_step_stats = step_stats
        unused = []
        if self.check_finite and pending:
            dev = next(iter(pending)).device
            bad = torch.stack(flags).any().to(torch.float32).reshape(1) if flags else torch.zeros(1, device=dev)
            # with skip_unused: [non-finite, then: used on this rank, per parameter in the optimizer's order]
            order = sorted(pending, key=self.optimizer.param_index) if self.skip_unused else []
            mine = torch.tensor([p in used or p not in self._watched for p in order], dtype=torch.float32)
            agreed = agree(torch.cat([bad, mine.to(dev)]), self.agree_group).tolist()
            unused = [p for p, flag in zip(order, agreed[1:]) if flag == 0.0]
            if agreed[0] != 0.0:
                self.skipped_steps += 1
                warnings.warn(
                    f"{type(self.optimizer).__name__}: a rank had a non-finite gradient; every rank skipped the step.",
                    RuntimeWarning,
                    stacklevel=4,
                )
                return None
        unseen = [
            p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None and p not in pending
        ]
        if unseen:
            p = unseen[0]
            raise RuntimeError(
                f"A parameter of shape {tuple(p.shape)} has a gradient but {self.hook_name} did not see it: every "
                f"parameter {type(self.optimizer).__name__} optimizes must belong to {self.wrapped_name} the hook "
                "is registered on."
            )
        for p in unused:  # no rank computed a gradient for it: no step, as for a gradient of None
            del pending[p]
        if pending:
            self.steps_communicated += 1
        return pending


class StepAllReduce(Communicator):
    """Birder's optimizer-side 1-bit all-reduce: ``step()`` encodes, all-reduces ``u`` and applies ``d``.

    For training loops without DDP (each rank computes its own gradient) and for sharded parameters. Every rank
    takes part in the same collectives with the same sizes, whatever gradients it has: one small all-reduce first
    agrees on which parameters have a gradient on any rank (a rank without one contributes ``g = 0``) and whether
    any rank's gradient is non-finite (then every rank skips the step); then one ``onebit_all_reduce`` of the
    concatenated ``u`` of those parameters.

    Args:
        topology (`Topology`, *optional*): the ranks and their nodes; default ``Topology.flat(process_group)``.
        process_group (`ProcessGroup`, *optional*): the ranks, when no ``topology`` is given.
        method (`str`, *optional*, defaults to `"hierarchical"`): the ``onebit_all_reduce`` method.
        inter_method (`str`, *optional*, defaults to `"allgather"`): hierarchical only.
        chunk_numel (`int`, *optional*): bound on the elements per collective.
        agree_group (`ProcessGroup`, *optional*): the ranks that agree on skipped steps and used parameters (default:
            the topology's); sharded parameters need every rank of the mesh (``birder_hf.fsdp`` passes it).

    Sharded parameters (FSDP2's ``DTensor``) are encoded, all-reduced and updated on their local shards.
    """

    def __init__(
        self,
        *,
        topology: Topology | None = None,
        process_group=None,
        method: str | None = None,
        inter_method: str = DEFAULT_INTER_METHOD,
        chunk_numel: int | None = None,
        agree_group=None,
    ):
        method = DEFAULT_METHOD if method is None else method
        check_settings(method, inter_method, chunk_numel)
        if topology is None:
            topology = Topology.flat(process_group)
        elif not isinstance(topology, Topology):
            raise TypeError(f"topology must be a birder_hf.Topology, got {type(topology).__name__}.")
        self.topology, self.method, self.inter_method, self.chunk_numel = topology, method, inter_method, chunk_numel
        self.agree_group = topology.world_group if agree_group is None else agree_group
        self.stats = CommStats()

    def finish_step(self) -> list[Update] | None:
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        grads = {p: p.grad for gg in opt.gradients() for p in gg.params}
        # [non-finite on any rank, then: has a gradient on any rank, per parameter]
        flags = torch.zeros(1 + len(params), dtype=torch.float32)
        flags[0] = 0.0 if all_finite(list(grads.values())) else 1.0
        flags[1:] = torch.tensor([p in grads for p in params], dtype=torch.float32)
        dev = params[0].device if params else torch.device("cpu")
        flags = agree(flags.to(dev), self.agree_group).cpu()
        if flags[0] != 0:
            warnings.warn(
                "Birder: a rank had a non-finite gradient; every rank skipped this step.", RuntimeWarning, stacklevel=4
            )
            return None
        used = {p for p, f in zip(params, flags[1:].tolist()) if f}
        batch = [(g, [p for p in g["params"] if p in used]) for g in opt.param_groups]
        batch = [(g, ps) for g, ps in batch if ps]
        if not batch:
            return []
        ordered = [p for _, ps in batch for p in ps]
        # before any state changes: the parameters still match their state, and every rank makes the same call
        # (one all-gather the first time this set of parameters is used; a cache lookup afterwards)
        opt.check_state_matches(ordered)
        dtype = ordered[0].new_empty(0, dtype=state_dtype(ordered[0])).dtype
        for p in ordered[1:]:
            dtype = torch.promote_types(dtype, state_dtype(p))
        check_agreement(
            sum(local_tensor(p).numel() for p in ordered),
            topology=self.topology,
            method=self.method,
            inter_method=self.inter_method,
            chunk_numel=self.chunk_numel,
            dtype=dtype,
            device=dev,
        )
        us = []
        for group, ps in batch:
            us += opt.encode(group, ps, [grads[p] if p in grads else torch.zeros_like(local_tensor(p)) for p in ps])
        keys = opt.bit_keys(ordered, [int(opt.state[p]["step"]) for p in ordered])
        flat = torch.cat([u.reshape(-1) for u in us])
        d = onebit_all_reduce(
            flat,
            topology=self.topology,
            method=self.method,
            inter_method=self.inter_method,
            keys=keys,
            chunk_numel=self.chunk_numel,
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
