"""The contract between birder-hf's optimizers and their communicators.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB

Two roles meet here (``docs/ARCHITECTURE.md`` draws them):

- the **optimizer** (:class:`birder_hf.Birder`, :class:`birder_hf.OneBitAdam`) owns the per-parameter state;
  it *encodes* each rank's gradient into what is sent (Birder: ``m, b -> u``) and *applies* the synchronized
  direction (Birder: ``x <- x - lr (d + wd x)``);
- a **communicator** turns the encoded values of every rank into that direction: none (one process: the
  optimizer quantizes locally), a DDP communication hook (during backward), or the optimizer-side all-reduce
  (inside ``step()``: loops without DDP, sharded parameters).

The protocol, all public and documented:

1. ``communicator.attach(optimizer)``, once; the optimizer refuses a second communicator.
2. Communicators ask the optimizer for what they need: :meth:`OneBitOptimizer.param_index` (the stable id
   that keys a parameter's random bits), :meth:`OneBitOptimizer.group_of`, ``optimizer.init_state(p, group)``,
   and each optimizer's own encode/commit methods.
3. ``optimizer.step()`` calls ``communicator.finish_step()``: the communicator agrees with the other ranks
   that the step is valid, commits what it staged, and returns what the optimizer applies, or ``None``: every
   rank skips the step, and state and parameters stay as they were.

This module never imports ``torch.distributed`` at import time.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.optim.optimizer import Optimizer

__all__ = ["OneBitOptimizer", "Communicator", "GroupGrads", "Update", "all_finite", "state_dtype", "unwrap_optimizer"]


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of a parameter's optimizer state: at least float32 (bf16/fp16 parameters keep float32 state)."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


class GroupGrads(NamedTuple):
    """The parameters of one param group that have a gradient this step, and those gradients."""

    group: dict
    params: list[torch.Tensor]
    grads: list[torch.Tensor]


class Update(NamedTuple):
    """What ``step()`` applies to one param group: one synchronized direction per parameter."""

    group: dict
    params: list[torch.Tensor]
    directions: list[torch.Tensor]


def unwrap_optimizer(optimizer):
    """The birder-hf optimizer inside framework wrappers (accelerate's ``AcceleratedOptimizer``, Lightning's, ...)."""
    seen = 0
    while not isinstance(optimizer, OneBitOptimizer) and hasattr(optimizer, "optimizer") and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


class Communicator:
    """Base of the objects that turn every rank's encoded values into the synchronized direction.

    Subclasses: :class:`birder_hf.BirderHookState` and :class:`birder_hf.OneBitAdamHookState` (DDP hooks) and
    :class:`birder_hf.communicators.StepAllReduce` (the optimizer-side 1-bit all-reduce).
    """

    __slots__ = ("optimizer",)

    def attach(self, optimizer: OneBitOptimizer) -> None:
        """Become ``optimizer``'s communicator (once; the optimizer refuses a second one)."""
        optimizer.attach_communicator(self)
        self.optimizer = optimizer

    def detach(self) -> None:
        """Stop being the optimizer's communicator (``step()`` then works as in one process)."""
        self.optimizer.detach_communicator(self)

    def finish_step(self):
        """Called by ``optimizer.step()``: commit and return what to apply, or ``None`` to skip the step everywhere."""
        raise NotImplementedError

    def amp_scaling(self) -> bool:
        """Whether ``step()`` takes the gradients from ``torch.amp.GradScaler`` without their being un-scaled (see
        :attr:`OneBitOptimizer._step_supports_amp_scaling`)."""
        return False

    def check_loss_scaled_step(self) -> None:
        """Called by ``step()`` when a ``GradScaler`` handed over loss-scaled gradients: raise if they are unusable."""


_warned_without_communicator: set[str] = set()


class OneBitOptimizer(Optimizer):
    """Base of Birder and OneBitAdam: rank-local state, a stable parameter index, one communicator.

    Rank-local state: ``m`` and ``b`` (and 1-bit Adam's error buffers) are built from each rank's own gradients,
    so they differ between ranks (``birder_hf.checkpoint`` saves one file per rank). ``load_state_dict`` keeps
    the float32 state of bf16/fp16 parameters float32 (``torch.optim.Optimizer`` would round it to the
    parameter's dtype), and a state staged with :meth:`stage_rank_state` wins over the one passed in (frameworks
    load rank 0's optimizer state on every rank; their load hook stages this rank's own first).
    """

    def __init__(self, params, defaults: dict):
        self.step_was_skipped = False  # whether the last step() skipped (a rank had a non-finite gradient)
        self._communicator: Communicator | None = None
        self._staged_state: dict | None = None
        self._index_cache: dict[torch.Tensor, tuple[int, dict]] | None = None
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("step_was_skipped", False)
        self.__dict__.setdefault("_communicator", None)
        self.__dict__.setdefault("_staged_state", None)
        self.__dict__.setdefault("_index_cache", None)

    # ---------------------------------------------------------------------------------- communicator
    @property
    def communicator(self) -> Communicator | None:
        """The communicator attached with :meth:`attach_communicator` (``None``: one process)."""
        return self._communicator

    def attach_communicator(self, communicator: Communicator) -> None:
        if self._communicator is not None:
            raise ValueError(
                f"This {type(self).__name__} optimizer already has a communicator "
                f"({type(self._communicator).__name__}): register the hook once per model and optimizer, and do not "
                "also pass process_group=/topology= to an optimizer whose model has the hook."
            )
        self._communicator = communicator

    def detach_communicator(self, communicator: Communicator) -> None:
        if self._communicator is communicator:
            self._communicator = None

    def _warn_if_distributed_without_communicator(self) -> None:
        name = type(self).__name__
        if name in _warned_without_communicator:
            return
        import torch.distributed as dist  # only to look: communication lives in the communicators

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            _warned_without_communicator.add(name)
            warnings.warn(
                f"{name} is running in a distributed job without its communication hook, so DDP averages gradients "
                "in full precision (32 bits per value) and each rank encodes on its own. Register the 1-bit hook: "
                "birder_hf.hook.attach_ddp_hook(model, optimizer), birder_hf.integrations.accelerate."
                "register_birder_hook, or BirderTrainer for the HF Trainer.",
                UserWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------------------------------------- step
    @property
    def _step_supports_amp_scaling(self) -> bool:
        """``torch.amp.GradScaler``'s opt-out: ``True`` makes ``scaler.step`` leave ``.grad`` as it is and call
        ``step()`` with ``grad_scale``/``found_inf`` attributes set, instead of un-scaling ``.grad`` and skipping
        ``step()`` on an overflow.

        One process: ``False``, the scaler's usual un-scaling. Under the DDP hook ``.grad`` holds the direction d,
        which must not be un-scaled (Birder's ``u = m / b`` does not depend on the loss scale, so the hook encodes the
        scaled gradients as they are): ``True``, except after a non-finite backward, whose NaN direction the scaler
        then finds (it skips ``step()`` and backs the scale off). With ``process_group=``/``topology=``: ``True``,
        every rank must call ``step()``, whose all-reduce agrees on skipping.
        """
        return self._communicator is not None and self._communicator.amp_scaling()

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One optimization step: alone (one process), or applying what the communicator agreed and staged."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.communicator is None:
            self._warn_if_distributed_without_communicator()
            self.step_was_skipped = self._step_alone()
        else:
            if hasattr(self, "found_inf"):  # GradScaler.step left the loss-scaled .grad to us (the opt-out above)
                self.communicator.check_loss_scaled_step()
            staged = self.communicator.finish_step()
            self.step_was_skipped = staged is None
            self._step_communicated(staged)
        return loss

    def _step_alone(self) -> bool:
        """One process: the whole step; returns whether it was skipped (a non-finite gradient)."""
        raise NotImplementedError

    def _step_communicated(self, staged) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------- parameters
    def _index(self) -> dict[torch.Tensor, tuple[int, dict]]:
        # param -> (its index over all groups, its group); rebuilt after add_param_group / load_state_dict,
        # which replace the group dicts
        if self._index_cache is None:
            pairs = [(p, g) for g in self.param_groups for p in g["params"]]
            self._index_cache = {p: (i, g) for i, (p, g) in enumerate(pairs)}
        return self._index_cache

    def param_index(self, p: torch.Tensor) -> int:
        """The stable index of ``p`` in the optimizer (its order over all param groups); keys its random bits."""
        return self._index()[p][0]

    def group_of(self, p: torch.Tensor) -> dict | None:
        """The param group that holds ``p`` (``None`` if the optimizer does not own it)."""
        entry = self._index().get(p)
        return None if entry is None else entry[1]

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._index_cache = None

    def gradients(self) -> list[GroupGrads]:
        """The parameters that have a gradient, per param group (groups without any are left out)."""
        out = []
        for group in self.param_groups:
            params, grads = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients; use dense ones (sparse=False)."
                    )
                params.append(p)
                grads.append(p.grad)
            if params:
                out.append(GroupGrads(group, params, grads))
        return out

    # ------------------------------------------------------------------------------------ state dicts
    def stage_rank_state(self, state_dict: dict) -> None:
        """Make the next :meth:`load_state_dict` load ``state_dict`` (this rank's own) instead of its argument."""
        self._staged_state = state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        if self._staged_state is not None:
            state_dict, self._staged_state = self._staged_state, None
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        keep = {}
        for saved_id, p in zip(saved_ids, params):
            if state_dtype(p) != p.dtype:
                for key, value in state_dict["state"].get(saved_id, {}).items():
                    if key != "step" and torch.is_tensor(value):
                        keep[(p, key)] = value
        super().load_state_dict(state_dict)
        for (p, key), value in keep.items():
            self.state[p][key] = value.to(device=p.device, dtype=torch.float32)
        self._index_cache = None


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite (one max-norm per device: inf or NaN exactly when an element is;
    a 2-norm would overflow on finite values)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(t)
    return all(
        bool(torch.stack([n.float() for n in torch._foreach_norm(ts, float("inf"))]).isfinite().all())
        for ts in by_device.values()
    )


# ---------------------------------------------------------------------------------------- validation
def is_real_number(value) -> bool:
    """A finite real number that is not a bool (``True`` is an ``int`` in Python)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
