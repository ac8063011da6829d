"""The contract between birder-hf's optimizers and their communicators.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB

The optimizer (:class:`birder_hf.Birder`, :class:`birder_hf.OneBitAdam`) owns the per-parameter state, encodes
each rank's gradient and applies the synchronized direction; a communicator turns every rank's encoded values into
that direction. The protocol (attach once; public questions only; ``step()`` calls ``finish_step()``, which returns
what to apply or ``None`` to skip the step on every rank) is in ``docs/ARCHITECTURE.md``, "The contract".

This module never imports ``torch.distributed`` at import time.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
from torch.optim.optimizer import Optimizer

__all__ = [
    "OneBitOptimizer",
    "Communicator",
    "GroupGrads",
    "Update",
    "Setting",
    "all_finite",
    "state_dtype",
    "unwrap_optimizer",
    "is_sharded",
    "local_tensor",
    "shard_offset",
    "shard_record",
]


def explain(what: str, fix: str) -> str:
    """An error message: what is wrong, then how to fix it (``"<what>; <fix>."``)."""
    return f"{what}; {fix}."


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (FSDP2's sharded parameters and gradients are)."""
    return hasattr(t, "placements") and hasattr(t, "to_local")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a ``DTensor``'s local shard (a view: writing it writes ``t``), else ``t``."""
    return t.to_local() if is_sharded(t) else t


def shard_offset(p: torch.Tensor) -> int:
    """The index, in ``p`` flattened, of the first element of this rank's shard (0 for a plain tensor).

    Birder keys a parameter's random bits by that index (``quantize.BitKeys``), so an element draws the same bit
    whichever rank holds it. Supported layouts: ``Replicate()`` and ``Shard(0)`` (FSDP2's default: rank ``i`` of the
    ``n`` ranks of a mesh dimension holds rows ``[i c, (i + 1) c)`` with ``c = ceil(rows / n)``), one mesh dimension
    sharding dim 0 at most; anything else raises ``ValueError``.
    """
    if not is_sharded(p):
        return 0
    shards = [(i, pl) for i, pl in enumerate(p.placements) if pl.is_shard()]
    if not shards:
        return 0
    if len(shards) > 1 or shards[0][1].dim != 0:
        what = f"Birder supports one Shard(0) placement (FSDP2's), got {p.placements} for shape {tuple(p.shape)}"
        raise ValueError(explain(what, "drop shard_placement_fn from fully_shard"))
    mesh_dim = shards[0][0]
    n, i = p.device_mesh.size(mesh_dim), p.device_mesh.get_local_rank(mesh_dim)
    rows = p.shape[0]
    chunk = -(-rows // n)
    start = min(i * chunk, rows)
    local = p.to_local()
    if local.shape[0] != min(chunk, rows - start) or tuple(local.shape[1:]) != tuple(p.shape[1:]):
        what = f"A parameter of shape {tuple(p.shape)} has a local shard of shape {tuple(local.shape)} on rank {i}"
        raise ValueError(explain(f"{what} of {n}, not torch.chunk's rows (FSDP2's layout)", "use FSDP2's layout"))
    return start * (p.numel() // rows if rows else 0)


def shard_record(p: torch.Tensor) -> tuple[int, int, int] | None:
    """``(offset, local numel, full numel)`` of this rank's shard of ``p`` (``None`` for a plain tensor).

    Kept in a sharded parameter's optimizer state (key ``"shard"``) so that a resume can check that each rank holds
    the same shard its state was built on.
    """
    if not is_sharded(p):
        return None
    return (shard_offset(p), local_tensor(p).numel(), p.numel())


def state_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of a parameter's optimizer state: at least float32 (bf16/fp16 parameters keep float32 state)."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


class GroupGrads(NamedTuple):
    """The parameters of one param group that have a gradient this step, and those gradients."""

    group: dict
    params: list[torch.Tensor]
    grads: list[torch.Tensor]


class Update(NamedTuple):
    """What ``step()`` applies to one param group: what the exchange gave each parameter, ``exchanged`` (Birder: its
    synchronized direction ``d``; 1-bit Adam's hook: its record of the exchange). Every communicator's
    ``finish_step`` returns a list of them, or ``None``."""

    group: dict
    params: list[torch.Tensor]
    exchanged: list[torch.Tensor]


def unwrap_optimizer(optimizer):
    """The birder-hf optimizer inside framework wrappers (accelerate's ``AcceleratedOptimizer``, Lightning's, ...)."""
    seen = 0
    while not isinstance(optimizer, OneBitOptimizer) and hasattr(optimizer, "optimizer") and seen < 8:
        optimizer, seen = optimizer.optimizer, seen + 1
    return optimizer


class Communicator:
    """Base of the objects that turn every rank's encoded values into the synchronized direction.

    Subclasses: :class:`birder_hf.communicators.HookState` (the DDP and FSDP hooks' states) and
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

    def check_plain_step(self) -> None:
        """Called by ``step()`` when no ``GradScaler`` called it: raise if the step needed one."""

    # the settings every rank's update must share (d is the same on every rank; lr and weight_decay turn it into the
    # update): compared at every step's agreement, which is one element-wise MAX all-reduce
    _SHARED = ("lr", "weight_decay")

    def shared_settings(self) -> list[float]:
        """``[x, -x]`` for each param group's lr and weight_decay: after a MAX all-reduce, each pair is the ranks'
        (largest, -smallest) value, equal on every rank, so every rank judges the same numbers."""
        return [v for g in self.optimizer.param_groups for k in self._SHARED for v in (float(g[k]), -float(g[k]))]

    def check_shared_settings(self, agreed: list[float]) -> None:
        """Raise (on every rank alike) if the MAX-reduced :meth:`shared_settings` show a setting differing by rank."""
        names = [(i, k) for i in range(len(self.optimizer.param_groups)) for k in self._SHARED]
        for (i, k), high, low in zip(names, agreed[0::2], agreed[1::2]):
            if high != -low:
                what = f"param group {i}'s {k} differs across the ranks (from {-low!r} to {high!r}) at this step: "
                what += "each rank would apply another update and the replicas would drift apart"
                fix = "set it on every rank alike (the same schedule on every rank, never on one rank only); nothing "
                fix += "was applied"
                raise RuntimeError(explain(what, fix))


_warned_without_communicator: set[str] = set()


class OneBitOptimizer(Optimizer):
    """Base of Birder and OneBitAdam: rank-local state, a stable parameter index, one communicator.

    Rank-local state: ``m`` and ``b`` (and 1-bit Adam's error buffers) are built from each rank's own gradients,
    so they differ between ranks (``birder_hf.checkpoint`` saves one file per rank). ``load_state_dict`` keeps
    the float32 state of bf16/fp16 parameters float32 (``torch.optim.Optimizer`` would round it to the
    parameter's dtype), and a state staged with :meth:`stage_rank_state` wins over the one passed in (frameworks
    load rank 0's optimizer state on every rank; their load hook stages this rank's own first).
    """

    # Validation, in one place for every way settings and state come in (the constructor, add_param_group,
    # load_state_dict): each optimizer lists its settings' rules, and says what its per-parameter state must hold.
    settings: ClassVar[dict[str, Setting]] = {}
    # settings a saved param group may lack (written before they existed): filled from the constructor's defaults
    optional_settings: ClassVar[tuple[str, ...]] = ()
    # every key a parameter's state may hold
    state_keys: ClassVar[tuple[str, ...]] = ()
    required_state: ClassVar[tuple[str, ...]] = ()  # keys every saved per-parameter state has
    tensor_state: ClassVar[tuple[str, ...]] = ()  # keys holding a tensor shaped like the (local) parameter

    # What it needs and supports: the hooks, the integrations and the model card ask these instead of testing types.
    takes_all_reduce_settings: ClassVar[bool] = True  # method/inter_method/chunk_numel shape its exchange
    loss_scaling: ClassVar[bool] = True  # trains with fp16 loss scaling (its hook divides the scale out)
    sharding_refusal: ClassVar[str | None] = None  # why it cannot train on FSDP2 shards (None: it can)
    metrics_prefix: ClassVar[str] = "birder/"  # the prefix of its logged communication metrics
    card_keys: ClassVar[tuple[str, ...]] = ()  # the param-group settings a model card lists
    card_name: ClassVar[str] = ""  # the model card's "- optimizer:" line
    card_title: ClassVar[str] = ""
    card_summary: ClassVar[str] = ""

    def __init__(self, params, defaults: dict):
        self.step_was_skipped = False  # whether the last step() skipped (a rank had a non-finite gradient)
        self._communicator: Communicator | None = None
        self._staged_state: dict | None = None
        self._shared_state = False  # holds a state loaded as it is on every rank (not this rank's own), see below
        self._index_cache: dict[torch.Tensor, tuple[int, dict]] | None = None
        self._check_settings(defaults, "")
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("step_was_skipped", False)
        self.__dict__.setdefault("_communicator", None)
        self.__dict__.setdefault("_staged_state", None)
        self.__dict__.setdefault("_shared_state", False)
        self.__dict__.setdefault("_index_cache", None)
        for group in self.param_groups:  # an older state dict may lack a newer setting (torch.optim does the same)
            for key in self.optional_settings:
                group.setdefault(key, self.defaults[key])

    def card_settings(self) -> dict:
        """The configured hyperparameters (first param group; a scheduled or Tensor ``lr`` as configured)."""
        g = self.param_groups[0]
        lr = g.get("initial_lr", g["lr"])
        lr = float(f"{lr.item():.7g}") if isinstance(lr, torch.Tensor) else lr
        return {k: lr if k == "lr" else g[k] for k in self.card_keys}

    def ddp_hook(self, *, topology, check_finite: bool, grad_scaler):
        """Its own DDP communication hook as ``(state, hook)``, or ``None`` for Birder's (``birder_hf.hook``)."""
        return None

    # ---------------------------------------------------------------------------------- communicator
    @property
    def communicator(self) -> Communicator | None:
        """The communicator attached with :meth:`attach_communicator` (``None``: one process)."""
        return self._communicator

    def attach_communicator(self, communicator: Communicator) -> None:
        self.check_own_state()
        if self._communicator is not None:
            what = f"This {type(self).__name__} already has a communicator ({type(self._communicator).__name__})"
            raise ValueError(
                explain(what, "register one hook per model and optimizer, and no process_group=/topology=")
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
            what = f"{name} runs in a distributed job without its communication hook: DDP averages 32-bit gradients"
            fix = (
                "register the 1-bit hook (birder_hf.hook.attach_ddp_hook; accelerate: register_birder_hook; Trainer: "
            )
            fix += "BirderTrainer; FSDP2: birder_hf.fsdp.register_birder_fsdp)"
            warnings.warn(explain(what, fix), UserWarning, stacklevel=4)

    # ------------------------------------------------------------------------------------------- step
    @property
    def _step_supports_amp_scaling(self) -> bool:
        """``torch.amp.GradScaler``'s opt-out: ``True`` makes ``scaler.step`` leave ``.grad`` as it is and call
        ``step()`` with ``grad_scale``/``found_inf`` set. The communicator answers (``docs/ARCHITECTURE.md``, "The
        contract", item 5); one process: ``False``, the scaler's usual un-scaling."""
        return self._communicator is not None and self._communicator.amp_scaling()

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One optimization step: alone (one process), or applying what the communicator agreed and staged."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_current_settings()  # changed since construction (a scheduler, an edit): before anything is written
        if self.communicator is None:
            self._warn_if_distributed_without_communicator()
            self.step_was_skipped = self._step_alone()
        else:
            self.check_own_state()  # a state loaded on every rank after the hook was registered
            scaled = hasattr(self, "found_inf")  # GradScaler.step left the loss-scaled .grad to us (the opt-out above)
            try:
                if scaled:
                    self.communicator.check_loss_scaled_step()
                else:
                    self.communicator.check_plain_step()
                staged = self.communicator.finish_step()
            except BaseException:
                # GradScaler.step deletes these only after a step() that returned: left behind, they would make every
                # later plain step() look loss-scaled, and multiply into the next scaler step's grad_scale
                for name in ("grad_scale", "found_inf"):
                    self.__dict__.pop(name, None)
                raise
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
        """Add a param group, after checking its parameters and settings (nothing is added if one is invalid)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict with a 'params' entry, got {type(param_group).__name__}.")
        where = f" in param group {len(self.param_groups)}"
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif isinstance(params, (set, dict)) or params is None:
            raise TypeError(
                "params argument given to the optimizer should be an iterable of Tensors or dicts (an ordered one: "
                f"a list, not a {type(params).__name__}), e.g. model.parameters()."
            )
        param_group["params"] = params = list(params)  # a generator is read once
        self._check_params([x[1] if isinstance(x, tuple) else x for x in params], where)
        self._check_group_keys(param_group, where)
        self._check_settings({k: v for k, v in param_group.items() if k != "params"}, where)
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

    def check_state_matches(self, params: list[torch.Tensor]) -> None:
        """Raise (before anything is written) if a parameter no longer matches its state (resized, or moved to another
        device after the state was made) or its gradient (another shape), or a setting of its group became invalid.
        """
        groups = {id(g): g for g in map(self.group_of, params) if g is not None}
        self.check_current_settings(list(groups.values()))
        for p in params:
            g = p.grad
            if g is not None and tuple(local_tensor(g).shape) != tuple(local_tensor(p).shape):
                what = f"A parameter of shape {tuple(p.shape)} has a gradient of shape {tuple(g.shape)}"
                fix = "resize the model before creating the optimizer; nothing was stepped"
                raise RuntimeError(explain(what, fix))
        for p in params:
            st = self.state.get(p)
            if not st:
                continue
            m, x = st.get("exp_avg"), local_tensor(p)
            if m is not None and (m.shape != x.shape or m.device != x.device):
                what = f"A parameter of shape {tuple(p.shape)} on {p.device} has state of shape {tuple(m.shape)}"
                fix = "move or resize the model before creating the optimizer (or loading its state)"
                raise RuntimeError(explain(f"{what} on {m.device}", fix))

    # ------------------------------------------------------------------------------------ state dicts
    def stage_rank_state(self, state_dict: dict) -> None:
        """Make the next :meth:`load_state_dict` load ``state_dict`` (this rank's own) instead of its argument."""
        self._staged_state = state_dict

    def load_own_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict``, this rank's own state (``birder_hf.checkpoint.read_own_rank_state``)."""
        self.stage_rank_state(state_dict)
        self.load_state_dict(state_dict)

    def check_own_state(self) -> None:
        """Refuse to communicate with a state loaded as it is on every rank of a distributed job.

        ``m`` and ``b`` are per rank, and frameworks save the optimizer state of rank 0 only: a plain
        ``load_state_dict`` in a job of several ranks (``accelerator.load_state`` before :func:`register_birder_hook`
        registered its per-rank load, a hand-made ``torch.load``) gives every rank rank 0's. Loading this rank's own
        state afterwards (:meth:`load_own_state_dict`, the integrations' resume paths) lifts the refusal."""
        if self._shared_state:
            name = type(self).__name__
            what = f"This {name}'s state was loaded with load_state_dict on every rank, so each rank holds the same m "
            what += "and b (frameworks save rank 0's only), not its own"
            fix = "register the 1-bit hook before loading (accelerate: register_birder_hook right after prepare, then "
            fix += "load_state / load_resumable_state), or load each rank's own with birder_hf.checkpoint."
            fix += "load_rank_state"
            raise RuntimeError(explain(what, fix))

    def load_state_dict(self, state_dict: dict) -> None:
        """Load ``state_dict`` after checking all of it: its param groups' settings, and every parameter's state
        (keys, shapes, dtypes, finite values, the optimizer's invariants). If anything is wrong, nothing is loaded."""
        own = self._staged_state is not None
        if own:
            state_dict, self._staged_state = self._staged_state, None
        self.check_state_dict(state_dict)
        round_trip = not own and self._holds(state_dict)
        self._warn_replaced_settings(state_dict["param_groups"])
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
        for key, st in self.state.items():  # torch.optim accepts a plain-number step; keep ours a tensor
            # (entries that are not a parameter's, which torch.optim keeps as they are, are left alone)
            if isinstance(key, torch.Tensor) and isinstance(st, dict) and not torch.is_tensor(st.get("step", st)):
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
        self._index_cache = None
        if not round_trip:  # (a round trip keeps what the state was: accelerate's prepare reloads it on its device)
            self._shared_state = not own and bool(self.state) and _world_size() > 1

    def _warn_replaced_settings(self, saved_groups: list[dict]) -> None:
        # torch.optim's rule: a loaded state's settings replace the constructor's. Say so when they differ, or the new
        # value is lost unseen (not lr, which a resumed schedule has moved on purpose, nor the seed, which a resume
        # restores for its bits, nor foreach, a choice of kernel)
        changed = [
            f"param group {i} {key}: {group[key]!r} -> {saved[key]!r}"
            for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups))
            for key in self.settings
            if key not in ("lr", "seed", "foreach") and key in saved and key in group and saved[key] != group[key]
        ]
        if changed:
            listed = "; ".join(changed)
            what = f"{type(self).__name__}.load_state_dict replaced settings with the saved ones ({listed})"
            fix = "as torch.optim does; to change one, set param_groups[i][key] after loading"
            warnings.warn(explain(what, fix), UserWarning, stacklevel=3)

    def _holds(self, state_dict: dict) -> bool:
        """Whether ``state_dict`` is this optimizer's state as it is now (a round trip through ``state_dict()``)."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        saved = state_dict["state"]
        for saved_id, p in zip(saved_ids, params):
            mine, theirs = self.state.get(p, {}), saved.get(saved_id, {})
            if mine.keys() != theirs.keys():
                return False
            for key, value in theirs.items():
                if torch.is_tensor(value) and not (
                    torch.is_tensor(mine[key]) and torch.equal(value.to(mine[key].device), mine[key])
                ):
                    return False
        return True

    # ------------------------------------------------------------------------------------- validation
    def _check_settings(self, settings: dict, where: str) -> None:
        """Raise ``ValueError`` for the first setting in ``settings`` that breaks its rule (others are left alone)."""
        for name, rule in self.settings.items():
            if name in settings:
                problem = rule.problem(settings[name])
                if problem is not None:
                    label = "learning rate " if name == "lr" else ""
                    what = f"Invalid {label}{name}={settings[name]!r}{where}"
                    raise ValueError(f"{what}: {problem.format(name=name)} ({type(self).__name__}).")

    def check_current_settings(self, groups: list[dict] | None = None) -> None:
        """Raise ``ValueError`` if a setting of ``groups`` (default: every param group) breaks its rule now: settings
        changed after construction (``param_groups[0]["beta"] = 2.0``, a scheduler returning NaN, a Tensor lr filled
        with NaN) are checked at every step, on the host values. A Tensor lr off the CPU is not read (that would wait
        for the device); its shape and dtype are checked."""
        for i, group in enumerate(self.param_groups if groups is None else groups):
            values = {k: group[k] for k in self.settings if k in group}
            lr = values.get("lr")
            if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
                values["lr"] = lr.new_zeros(()).cpu() if lr.numel() == 1 and lr.is_floating_point() else lr.cpu()
            index = next(j for j, g in enumerate(self.param_groups) if g is group) if groups is not None else i
            missing = [k for k in self.settings if k not in group]
            if missing:  # deleted since construction (the encode would raise a bare KeyError)
                what = f"Param group {index} lacks {type(self).__name__}'s settings {missing} (at step(): removed?)"
                fix = "set them back (param_groups[i][key] = value), or rebuild the optimizer"
                raise ValueError(explain(what, fix))
            self._check_settings(values, f" in param group {index} (at step(): changed since it was set?)")

    # names a param group may hold that are settings of other optimizers: a group holding one meant something
    # this optimizer ignores (e.g. Adam's betas for Birder's beta)
    _FOREIGN_SETTINGS = ("beta", "betas", "eps", "momentum", "nesterov", "dampening", "rho", "alpha")

    def _check_group_keys(self, param_group: dict, where: str) -> None:
        """Refuse a key that looks like a misspelled setting (``weight_decy``) or is another optimizer's (``betas``):
        it would be kept and ignored. Other keys (``name``, timm's ``lr_scale``, ``param_names``) are left alone."""
        import difflib

        name = type(self).__name__
        for key in param_group:
            if key == "params" or key in self.settings or not isinstance(key, str):
                continue
            close = difflib.get_close_matches(key, list(self.settings), n=1, cutoff=0.8)
            if close or key in self._FOREIGN_SETTINGS:
                hint = f"did you mean {close[0]!r}?" if close else f"{name}'s settings are {', '.join(self.settings)}"
                raise ValueError(f"Unknown setting {key!r}{where}: {name} would keep it and ignore it ({hint}).")

    def _check_params(self, params: list, where: str) -> None:
        """Real floating-point parameters, each once (torch only warns about a duplicate: it would step twice)."""
        name = type(self).__name__
        for i, p in enumerate(params):
            if isinstance(p, torch.Tensor) and not p.is_floating_point():
                what = f"{name} optimizes real floating-point parameters; parameter {i}{where} is {p.dtype}"
                fix = "pass model.parameters(), not model.state_dict().values()"
                raise TypeError(explain(what, "optimize a real view (torch.view_as_real)" if p.is_complex() else fix))
        seen: set[int] = set()
        for i, p in enumerate(params):
            if id(p) in seen:
                what = f"Parameter {i}{where} (shape {tuple(p.shape)}) appears twice in the group"
                raise ValueError(explain(what, "Pass each parameter once (list(dict.fromkeys(params)))"))
            seen.add(id(p))

    def _state_problem(self, p: torch.Tensor, state: dict, group: dict) -> str | None:
        """What is wrong with ``state``, one parameter's saved state (``group``: its saved settings), or ``None``.

        Checks the keys (only :attr:`state_keys`, every one of :attr:`required_state`), the step count and the shape
        of every :attr:`tensor_state` tensor; subclasses add their own invariants after calling this."""
        unknown = sorted(set(state) - set(self.state_keys))
        if unknown:
            return f"has keys {unknown} that {type(self).__name__}'s state does not have"
        missing = [k for k in self.required_state if k not in state]
        if missing:
            return f"lacks {missing}"
        problem = step_problem(state["step"]) if "step" in state else None
        shape = local_tensor(p).shape
        tensors = [k for k in self.tensor_state if k in state]
        return problem or next(filter(None, (tensor_problem(state, k, shape) for k in tensors)), None)

    def check_state_dict(self, state_dict) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, changing nothing."""
        name = type(self).__name__
        if (
            not isinstance(state_dict, dict)
            or not isinstance(state_dict.get("state"), dict)
            or not isinstance(state_dict.get("param_groups"), list)
        ):
            keys = f" with keys {sorted(map(str, state_dict))}" if isinstance(state_dict, dict) else ""
            what = f"{name}.load_state_dict got {type(state_dict).__name__}{keys}"
            raise TypeError(
                explain(what, f"pass what {name}.state_dict() returns (a dict with 'state', 'param_groups')")
            )
        saved_groups, states = state_dict["param_groups"], state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            what = f"The state dict has {len(saved_groups)} param groups, this {name} {len(self.param_groups)}"
            raise ValueError(explain(what, "build the optimizer with the param groups of the one saved"))
        foreign = _foreign_optimizer(saved_groups, states, self)
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            where = f" in param group {i} of the state dict being loaded"
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
                raise ValueError(f"Param group {i} of the state dict being loaded is not a dict with a 'params' list.")
            if len(saved["params"]) != len(group["params"]):
                sizes = f"{len(saved['params'])} parameters, this one {len(group['params'])}"
                what = f"Param group {i} of the state dict has {sizes}"
                raise ValueError(explain(what, "load the state of the same model and param groups"))
            missing = [k for k in self.settings if k not in saved and k not in self.optional_settings]
            if foreign:
                lacks = f" (param group {i} lacks {missing})" if missing else ""
                what = f"The state dict looks like the state of {foreign}, not of {name}{lacks}"
                raise ValueError(explain(what, f"load only the model's weights and let {name} start from zero state"))
            if missing:
                what = f"Param group {i} of the state dict being loaded lacks {name}'s settings {missing}"
                fix = f"load the state dict {name} saved (per rank: birder_hf.checkpoint.load_rank_state)"
                raise ValueError(explain(what, fix))
            self._check_settings(saved, where)
        saved_ids = [i for g in saved_groups for i in g["params"]]
        # torch.optim keeps entries of "state" that belong to no parameter as they are (hooks and libraries stash
        # flags there); one that holds a parameter's state under a key no param group lists is a mismatch, which would
        # otherwise load as zero state
        ids = set(saved_ids)
        stray = [
            k
            for k, v in states.items()
            if k not in ids and isinstance(v, dict) and any(key in v for key in self.required_state)
        ]
        if stray:
            what = f"The state dict has {name} state under keys {sorted(stray, key=str)[:5]} that none of its param "
            what += f"groups lists (they list {sorted(ids, key=str)[:5]}{' ...' * (len(ids) > 5)})"
            raise ValueError(explain(what, f"load what {name}.state_dict() wrote, keys unchanged; nothing was loaded"))
        self._check_shards(state_dict, saved_ids, [p for g in self.param_groups for p in g["params"]])
        for i, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            settings = {**self.defaults, **saved}
            for j, (saved_id, p) in enumerate(zip(saved["params"], group["params"])):
                state = states.get(saved_id)
                if not state:
                    continue
                problem = self._state_problem(p, state, settings) if isinstance(state, dict) else "is not a dict"
                if problem is not None:
                    what = f"The state of parameter {j} (shape {tuple(p.shape)}) in param group {i} {problem}"
                    raise ValueError(explain(what + "; nothing was loaded", f"load what {name}.state_dict() wrote"))

    def _check_shards(self, state_dict: dict, saved_ids: list, params: list) -> None:
        # a sharded parameter's m, b cover this rank's shard only: they load onto the same shard or not at all
        for index, (saved_id, p) in enumerate(zip(saved_ids, params)):
            saved = state_dict["state"].get(saved_id)
            if not isinstance(saved, dict) or not torch.is_tensor(saved.get("exp_avg")):
                continue
            record = saved.get("shard")
            record = None if record is None else tuple(int(v) for v in record)
            if (is_sharded(p) or record is not None) and record != shard_record(p):
                what = f"{type(self).__name__}.load_state_dict: parameter {index}'s state (shape {tuple(p.shape)}) is "
                what += f"for {_describe_shard(record)}, this rank holds {_describe_shard(shard_record(p))}"
                fix = "resume on the same mesh shape, wrapping and rank order. Nothing was loaded"
                raise ValueError(explain(what, fix))


def _world_size() -> int:
    import torch.distributed as dist  # only to look: communication lives in the communicators

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _describe_shard(record) -> str:
    if record is None:
        return "the whole parameter (not sharded)"
    offset, numel, full = record
    return f"elements [{offset}, {offset + numel}) of {full}"


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of ``tensors`` is finite (one max-norm per device: inf or NaN exactly when an element is;
    a 2-norm would overflow on finite values)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in map(local_tensor, tensors):  # a sharded gradient: this rank's shard (no collective)
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


def is_integer(value) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class Setting(NamedTuple):
    """The rule of one setting: ``problem(value)`` is ``None`` for a valid value, else what a valid one looks like
    (``"{name} must be ..."``)."""

    problem: Callable[[Any], str | None]


def rule(ok: Callable[[Any], bool], expect: str) -> Setting:
    return Setting(lambda value: None if ok(value) else "{name} must be " + expect)


def _lr_problem(value) -> str | None:
    if isinstance(value, torch.Tensor):  # torch.optim accepts a 1-element Tensor lr (schedulers, compiled steps)
        if value.numel() != 1:
            return "Tensor lr must be 1-element"
        if not value.is_floating_point() or not bool(torch.isfinite(value).all()) or float(value) < 0:
            return "{name} must be a finite float >= 0 (a 1-element float Tensor here)"
        return None
    return None if is_real_number(value) and value >= 0 else "{name} must be a finite float >= 0 (e.g. 1e-3)"


LR = Setting(_lr_problem)
NON_NEGATIVE = rule(lambda v: is_real_number(v) and v >= 0, "a finite float >= 0")
FLAG = rule(lambda v: isinstance(v, bool), "True or False")
OPTIONAL_FLAG = rule(lambda v: v is None or isinstance(v, bool), "None, True or False")
INTEGER = rule(is_integer, "an int")


def choice(options: tuple) -> Setting:
    """One of ``options``."""
    return rule(lambda v: isinstance(v, str) and v in options, f"one of {', '.join(map(repr, options))}")


def tensor_problem(state: dict, key: str, shape) -> str | None:
    """What is wrong with ``state[key]`` as a floating-point, finite state tensor of ``shape``, or ``None``."""
    value = state[key]
    if not isinstance(value, torch.Tensor):
        return f"has {key} of type {type(value).__name__}, not a tensor"
    if shape is not None and tuple(value.shape) != tuple(shape):
        return f"has {key} of shape {tuple(value.shape)} (a state dict of another model or parameter order?)"
    if not value.is_floating_point():
        return f"has {key} of dtype {value.dtype}, not a real floating-point one"
    if value.numel() and not bool(torch.isfinite(value).all()):
        return f"has NaN or inf in {key}"
    return None


def step_problem(step) -> str | None:
    """What is wrong with a saved ``step`` count (a tensor of one element or a number), or ``None``."""
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.is_complex():
            return f"has a step of shape {tuple(step.shape)}, not one number"
        step = step.item()
    if not is_real_number(step) or step < 0 or step != int(step):
        return f"has step={step!r}, not a whole number >= 0"
    return None


# per-parameter state keys that name the torch.optim optimizer that wrote them
_FOREIGN_STATE = {
    "exp_avg_sq": "torch.optim.Adam/AdamW",
    "max_exp_avg_sq": "torch.optim.Adam/AdamW",
    "momentum_buffer": "torch.optim.SGD",
    "square_avg": "torch.optim.RMSprop/Adadelta",
    "sum": "torch.optim.Adagrad",
    "exp_inf": "torch.optim.Adamax",
    "mu_product": "torch.optim.NAdam",
}
_TORCH_FLAGS = {"capturable", "fused", "differentiable", "decoupled_weight_decay", "nesterov", "dampening"}


def _foreign_optimizer(saved_groups: list, states: dict, opt: OneBitOptimizer) -> str | None:
    """The optimizer that wrote a state dict, when its keys say it is not ``opt``'s kind (``None``: no sign of it)."""
    for other in OneBitOptimizer.__subclasses__():  # Birder, OneBitAdam: their own settings name them first (a
        own = set(other.settings) - set(opt.settings)  # OneBitAdam state also has Adam's exp_avg_sq)
        if other is not type(opt) and own and any(isinstance(g, dict) and own <= set(g) for g in saved_groups):
            return f"birder_hf.{other.__name__}"
    for state in states.values():
        for key in state if isinstance(state, dict) else ():
            if key in _FOREIGN_STATE and key not in opt.state_keys:
                return _FOREIGN_STATE[key]
    for group in saved_groups:
        if isinstance(group, dict) and _TORCH_FLAGS & (set(group) - set(opt.settings)):
            return (
                "torch.optim.Adam/AdamW"
                if "betas" in group
                else "torch.optim.SGD"
                if "momentum" in group
                else ("a torch.optim optimizer")
            )
    return None
