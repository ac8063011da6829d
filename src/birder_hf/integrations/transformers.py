"""Birder with the Hugging Face ``Trainer``: ``BirderTrainer`` (or ``BirderTrainerMixin`` for your subclass).

One line for users: ``Trainer(...)`` becomes ``BirderTrainer(..., birder_args=BirderArguments())``.

Why a subclass and not only a callback: a ``TrainerCallback`` sees the unwrapped model, not the DDP
module the hook must be registered on, and it cannot put numbers into the logs that TensorBoard and
friends receive, nor learn which checkpoint a resume starts from. The subclass uses the public seams
``create_optimizer`` (Birder by default), ``train`` (remembers ``resume_from_checkpoint``),
``log`` (adds communication statistics), ``create_model_card`` (names Birder), plus a callback it
installs itself for ``on_train_begin`` (after DDP wrapping and the framework's optimizer load: registers
the hook, loads this rank's own Birder state, every rank together) and ``on_optimizer_step`` (tells the Trainer
when Birder skipped a step), and protected methods of the Trainer: ``_save_optimizer_and_scheduler(output_dir)``
writes every rank's Birder state into the very folder the Trainer saves to (``run-*/checkpoint-N`` in a
hyperparameter search), inside the checkpoint step (a callback's ``on_save`` runs after the Trainer has marked the
checkpoint complete and rotated old ones away, so a failed write there could leave no complete checkpoint);
``_save_checkpoint`` says when the disk is full and marks the checkpoint complete once every rank has written it
(``birder_hf.elastic.mark_checkpoint_complete``; old checkpoints are rotated away only after that), so that
``train(resume_from_checkpoint="auto")`` (``--resume_from_checkpoint auto``: what an elastic restart runs) resumes
from the newest checkpoint complete on every rank, or starts fresh; ``_get_grad_norm`` (see below).
For your own Trainer subclass: ``class MyTrainer(BirderTrainerMixin, Seq2SeqTrainer): ...``.
``optimizer_cls_and_kwargs=(Birder, {...})`` and ``optimizers=(Birder(...), None)`` work too.

What it changes, on purpose (``docs/SETUPS.md``, "Hugging Face Trainer"): a positive ``max_grad_norm`` is set to 0
with a warning, in the Trainer's own copy of the ``TrainingArguments`` (after the hook ``.grad`` holds the direction
``d``: clipping it is meaningless); no ``grad_norm`` is logged (the norm of ``d``); a step Birder skipped holds the
learning-rate schedule back; ``fp16`` trains with loss scaling. Refused at construction: an ``optim`` other than the
default (it would be ignored), 1-bit Adam with ``fp16``, the Trainer's own ``--fsdp`` and DeepSpeed (for sharded
training use ``BirderArguments(sharding="hsdp")``, below).

Sharded training (``BirderArguments(sharding="hsdp")``, our extension of the paper, ``birder_hf.fsdp``): the
Trainer shards the model itself with FSDP2 on the ``"shard"`` dimension of a ``(nodes, ranks per node)`` mesh (every
block of ``_no_split_modules``, then the root), so FSDP reduce-scatters gradients inside each node in full precision
and Birder's 1-bit all-reduce is the only traffic across nodes. This runs wherever ``torchrun`` runs, CPU included
(accelerate's FSDP plugin needs GPUs). ``HSDPTrainer`` is the same sharding with native HSDP (full-precision
all-reduce across nodes) for any other optimizer: the uncompressed baseline.

Local steps (``LocalStepsTrainer(..., local_args=LocalStepsArguments(local_steps=H))``, ``birder_hf.local_steps``):
the Trainer's own optimizer runs H steps on each rank alone, then the ranks exchange the pseudo-gradient at 1 bit per
parameter and take DiLoCo's outer step. Its per-rank checkpoints, the completion marker and ``"auto"`` resume are
``BirderTrainer``'s (``RankStateTrainerMixin``, which both use); a callback builds the ``LocalSteps`` after DDP
wrapping, counts every optimizer step and exchanges a partial round when training ends.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from typing import ClassVar

from ..base import OneBitOptimizer, explain, is_integer, unwrap_optimizer
from ..checkpoint import disk_full_error, load_rank_state, read_own_rank_state, save_rank_state
from ..communicators import HookState
from ..elastic import claim_output_dir, clear_completion_marker, find_resumable_checkpoint, mark_checkpoint_complete
from ..fsdp import register_birder_fsdp
from ..hook import attach_ddp_hook
from ..local_steps import LocalSteps
from ..model_card import fix_trainer_card, model_card_section, optimizer_description
from ..onebit_adam import OneBitAdam
from ..optim import DEFAULT_STALE, Birder
from ..settings import DEFAULT_INTER_METHOD, DEFAULT_METHOD, check_settings
from ..topology import Topology
from . import needs_extra
from .accelerate import check_really_distributed, report_skipped_step
from .hsdp_trainer import HSDPTrainer, ShardedTrainerMixin

with needs_extra(__name__, "transformers", "transformers"):
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

__all__ = [
    "BirderArguments",
    "BirderTrainerMixin",
    "BirderTrainer",
    "BirderCallback",
    "ShardedTrainerMixin",
    "HSDPTrainer",
    "RankStateTrainerMixin",
    "LocalStepsArguments",
    "LocalStepsCallback",
    "LocalStepsTrainerMixin",
    "LocalStepsTrainer",
]

logger = logging.getLogger(__name__)

OPTIMIZERS = ("birder", "onebitadam")


@dataclass
class BirderArguments:
    """Birder's settings, parsed by ``HfArgumentParser`` next to ``TrainingArguments``.

    ``optimizer="onebitadam"`` trains with :class:`birder_hf.OneBitAdam` instead (the paper's compressed baseline:
    ``freeze_step`` full-precision Adam steps, then 1-bit momentum with error feedback; ``TrainingArguments``'
    ``adam_beta1/adam_beta2/adam_epsilon`` apply); the Birder-only settings are then not used.
    """

    optimizer: str = field(default="birder", metadata={"help": "birder | onebitadam (1-bit Adam, Tang et al. 2021)."})
    freeze_step: int = field(
        default=100, metadata={"help": "onebitadam only: full-precision Adam warm-up steps before compressing."}
    )
    beta: float = field(default=0.95, metadata={"help": "EMA factor of m and b (the paper's beta)."})
    method: str = field(
        default=DEFAULT_METHOD,
        metadata={"help": "1-bit all-reduce: allgather | scatter_gather | hierarchical (node x GPU layout)."},
    )
    inter_method: str = field(
        default=DEFAULT_INTER_METHOD,
        metadata={"help": "hierarchical only: inter-node exchange, allgather | scatter_gather."},
    )
    chunk_numel: int | None = field(
        default=None, metadata={"help": "Elements per collective (bounds receive buffers; higher => fewer calls)."}
    )
    amsgrad: bool = field(default=False, metadata={"help": "Use max_t b_t (the theory's variant)."})
    beta2: float | None = field(
        default=None,
        metadata={"help": "Opt-in: vote on clip(m_hat / sqrt(v_hat), -1, 1), v's EMA factor (0.999); None: m / b."},
    )
    grad_clip: float | None = field(
        default=None,
        metadata={"help": "Opt-in: clip each parameter's gradient, on each rank, to its share of this global norm."},
    )
    error_feedback: bool = field(
        default=False, metadata={"help": "Opt-in: vote sign(u + e), each rank keeping its rounding error e."}
    )
    stale: str = field(
        default=DEFAULT_STALE,
        metadata={"help": "A 0 gradient: fade (vote decays by beta: bounded drift) | lazy (no vote) | keep (paper)."},
    )
    quantize: bool = field(
        default=True, metadata={"help": "Binary randomization; False sends u itself (one process only, a reference)."}
    )
    num_nodes: int | None = field(
        default=None,
        metadata={"help": "Nodes to split the ranks into (overrides LOCAL_WORLD_SIZE; simulates nodes on one host)."},
    )
    sharding: str = field(
        default="none",
        metadata={"help": "none (DDP: each rank holds the whole model) | hsdp (FSDP2 in each node, 1 bit across)."},
    )

    optimizers: ClassVar[tuple[str, ...]] = OPTIMIZERS  # a recipe's subclass may add its uncompressed baselines

    def __post_init__(self):
        # the same rules as the objects these settings build (set from Python, a value may have any type)
        if self.optimizer not in self.optimizers:
            raise ValueError(f"optimizer={self.optimizer!r}; choose one of {', '.join(self.optimizers)}.")
        check_settings(self.method, self.inter_method, self.chunk_numel)
        rules = {
            "beta": Birder.settings["beta"],
            "freeze_step": OneBitAdam.settings["freeze_step"],
            "amsgrad": Birder.settings["amsgrad"],
            "beta2": Birder.settings["beta2"],
            "grad_clip": Birder.settings["grad_clip"],
            "error_feedback": Birder.settings["error_feedback"],
            "stale": Birder.settings["stale"],
            "quantize": Birder.settings["quantize"],
        }
        for name, rule in rules.items():
            problem = rule.problem(getattr(self, name))
            if problem is not None:
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}: {problem.format(name=name)}.")
        if self.num_nodes is not None and not (is_integer(self.num_nodes) and self.num_nodes >= 1):
            what = f"Invalid num_nodes={self.num_nodes!r}"
            raise ValueError(explain(what, "pass None (the launcher's layout) or an int >= 1 dividing the processes"))
        if self.sharding not in ("none", "hsdp"):
            raise ValueError(f"sharding={self.sharding!r}; choose none or hsdp.")

    def topology(self) -> Topology:
        """The topology these arguments ask for (collective: every rank must call it)."""
        return _topology(self.num_nodes, "--num_nodes")

    def communication(self) -> dict:
        """Birder's all-reduce settings, as listed in model cards."""
        out = {"method": self.method, "inter_method": self.inter_method, "chunk_numel": self.chunk_numel}
        if self.num_nodes is not None:
            out["num_nodes"] = self.num_nodes
        if self.sharding != "none":
            out["sharding"] = self.sharding
        return out


class BirderCallback(TrainerCallback):
    """Registers the 1-bit hook and saves/loads per-rank optimizer state; installed by ``BirderTrainerMixin``."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        opt = unwrap_optimizer(trainer.optimizer)
        if not isinstance(opt, OneBitOptimizer):
            raise TypeError(f"BirderTrainer needs a Birder (or OneBitAdam) optimizer, got {type(opt).__name__}.")
        if trainer._birder_resume_dir is not None:
            # the Trainer just loaded rank 0's optimizer.pt into every rank; take this rank's own state (every rank
            # together: one rank's missing or corrupt file stops them all at once)
            folder, rank, world = trainer._birder_resume_dir, args.process_index, args.world_size
            opt.load_own_state_dict(read_own_rank_state(opt, folder, rank=rank, world_size=world))
        check_really_distributed(args.world_size)
        hooked = trainer.birder_hook_state
        if args.world_size == 1 or (hooked is not None and hooked.optimizer is opt):
            return
        # a new optimizer (first train(), or a new trial of hyperparameter_search / model_init): a new hook, on the
        # new DDP model; the previous one's process groups are released first
        if hooked is not None:
            hooked.close()
        b = trainer.birder_args
        comm = {"method": b.method, "inter_method": b.inter_method, "chunk_numel": b.chunk_numel}
        comm["grad_scaler"] = getattr(trainer.accelerator, "scaler", None)  # fp16: the hook divides its scale out
        if trainer.birder_mesh is not None:
            trainer.birder_hook_state = register_birder_fsdp(trainer.model, opt, trainer.birder_mesh, **comm)
            logger.info("%s: %s on %r", type(opt).__name__, trainer.birder_hook_state.description, trainer.birder_mesh)
            return
        trainer.birder_hook_state = attach_ddp_hook(trainer.model_wrapped, opt, topology=b.topology(), **comm)
        state = trainer.birder_hook_state
        logger.info("%s: %s registered on %r", type(opt).__name__, state.description, state.topology)

    def on_optimizer_step(self, args, state, control, **kwargs):
        # the Trainer steps the LR scheduler unless accelerate reports the optimizer step as skipped
        opt = unwrap_optimizer(self.trainer.optimizer)
        report_skipped_step(self.trainer.optimizer, getattr(opt, "step_was_skipped", False))


class RankStateTrainerMixin:
    """What a Trainer whose ranks hold different state needs: every rank writes its own state
    (:meth:`rank_state_owner`'s) into each checkpoint, which is marked complete once every rank has, and
    ``train(resume_from_checkpoint="auto")`` resumes from the newest complete one (module docstring)."""

    _birder_resume_dir: str | None = None

    def rank_state_owner(self):
        """The object whose per-rank state each checkpoint holds (``state_dict``, ``load_own_state_dict``)."""
        raise NotImplementedError

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        # every rank's own state (Birder's, or LocalSteps'), into the folder the Trainer saves this checkpoint to (a
        # trial's run-*/checkpoint-N included), inside the checkpoint step: before trainer_state.json marks the
        # checkpoint complete and before old checkpoints are rotated away (a failure here keeps the previous one)
        rank, world = self.args.process_index, self.args.world_size
        save_rank_state(self.rank_state_owner(), output_dir, rank=rank, world_size=world)

    def _save_checkpoint(self, model, trial) -> None:
        args = self.args
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if args.should_save:
            clear_completion_marker(folder)  # written again: not complete until every rank has written it
        # old checkpoints are rotated away only once this one is marked complete (the Trainer rotates right after
        # writing trainer_state.json, while other ranks may still be writing)
        limit, args.save_total_limit = args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
            if not args.save_only_model:  # no optimizer state: nothing to resume from
                mark_checkpoint_complete(
                    folder, rank=args.process_index, world_size=args.world_size, write=args.should_save
                )
        except Exception as exc:
            step = f"checkpoint-{self.state.global_step}"
            kept = f"The new {step} is incomplete (delete it); the checkpoints saved before it are kept"
            full = disk_full_error(exc, self.args.output_dir, kept=kept)
            if full is None:
                raise
            if isinstance(exc, OSError) and exc.errno == full.errno:  # it says so already
                exc.add_note(f"birder_hf: {kept}.")
                raise
            raise full from exc
        finally:
            args.save_total_limit = limit
        if args.should_save:
            rotate_checkpoints(
                output_dir=self._get_output_dir(trial=trial),
                save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # this job's output_dir, before anything is written there or resumed from it (another job writing it, or a
        # folder that cannot be written, stops every rank now rather than at the first checkpoint)
        claim_output_dir(self.args.output_dir, holder=self.args.should_save, world_size=self.args.world_size)
        if resume_from_checkpoint == "auto":  # the newest checkpoint complete on every rank; none: a fresh start
            if self.args.save_only_model:
                what = "resume_from_checkpoint='auto' with save_only_model=True: those checkpoints hold no optimizer "
                what += "state (no per-rank Birder state), so none can be resumed"
                fix = "drop save_only_model (--save_only_model false) to write resumable ones"
                raise ValueError(explain(what, fix))
            resume_from_checkpoint = find_resumable_checkpoint(self._get_output_dir(kwargs.get("trial")))
        elif resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No checkpoint found in {self.args.output_dir} to resume from.")
        self._birder_resume_dir = resume_from_checkpoint or None
        return super().train(resume_from_checkpoint, *args, **kwargs)


class BirderTrainerMixin(RankStateTrainerMixin, ShardedTrainerMixin):
    """Mix into any ``transformers.Trainer`` subclass (first in the bases) to train with Birder."""

    def __init__(self, *args, birder_args: BirderArguments | None = None, **kwargs):
        birder_args = birder_args if birder_args is not None else BirderArguments()
        if birder_args.optimizer not in OPTIMIZERS:
            raise ValueError(f"BirderArguments.optimizer={birder_args.optimizer!r}; choose birder or onebitadam.")
        training_args = kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None)
        _check_supported_setup(training_args, birder_args)
        if training_args is not None:
            # a copy: max_grad_norm is set to 0 below, and the Trainer changes its args too (hyperparameter search);
            # the caller's object, which a baseline Trainer may reuse, stays as it was
            training_args = copy.copy(training_args)
            if "args" in kwargs:
                kwargs["args"] = training_args
            else:
                args = (*args[:1], training_args, *args[2:])
        super().__init__(*args, **kwargs)
        self.birder_args = birder_args
        self.birder_hook_state: HookState | None = None
        _check_supported_setup(self.args, birder_args, self)
        if self.args.max_grad_norm and self.args.max_grad_norm > 0:
            logger.warning(
                "Birder: max_grad_norm=%s set to 0: .grad holds the 1-bit direction d, whose step lr bounds already "
                "(to clip each rank's gradient before it is encoded: BirderArguments(grad_clip=...)).",
                self.args.max_grad_norm,
            )
            self.args.max_grad_norm = 0.0
        self.add_callback(BirderCallback(self))
        if birder_args.sharding == "hsdp":
            self.shard_for_training(birder_args.num_nodes, across_nodes=False)

    def create_optimizer(self, model=None):
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            a, b = self.args, self.birder_args
            if b.optimizer == "onebitadam":
                cls = OneBitAdam
                extra = dict(betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon, freeze_step=b.freeze_step)
            else:
                cls = Birder
                rule = dict(beta=b.beta, amsgrad=b.amsgrad, beta2=b.beta2, grad_clip=b.grad_clip, stale=b.stale)
                extra = dict(rule, error_feedback=b.error_feedback, quantize=b.quantize, seed=a.seed)
            self.optimizer_cls_and_kwargs = (cls, dict(lr=a.learning_rate, weight_decay=a.weight_decay, **extra))
        return super().create_optimizer(model) if model is not None else super().create_optimizer()

    def rank_state_owner(self):
        return self.optimizer

    def _load_optimizer_and_scheduler(self, checkpoint):
        # the Trainer loads rank 0's optimizer.pt into every rank: this rank's own state wins (sharded m, b would not
        # even fit another rank's shard); on_train_begin loads it again, for Trainers that load elsewhere
        opt = unwrap_optimizer(self.optimizer)
        if checkpoint is not None and isinstance(opt, OneBitOptimizer):
            opt.stage_rank_state(
                read_own_rank_state(opt, checkpoint, rank=self.args.process_index, world_size=self.args.world_size)
            )
        return super()._load_optimizer_and_scheduler(checkpoint)

    def _get_grad_norm(self, model, grad_norm=None):
        # after the hook .grad holds d, whose norm says nothing about the gradient, and with fp16 the Trainer's
        # norm would un-scale .grad (GradScaler.unscale_); log no norm
        return grad_norm

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        state = self.birder_hook_state
        if state is not None and "loss" in logs and state.steps_communicated:
            logs.update(state.metrics())
        super().log(logs, *args, **kwargs)

    def create_model_card(self, *args, metrics: dict[str, float] | None = None, **kwargs) -> None:
        """The Trainer's model card, corrected for Birder (also what ``push_to_hub(**kwargs)`` writes).

        It names the optimizer that was used with its configured values and lists its settings, says "trained from
        scratch" for a randomly initialized model (the Trainer links an empty base model), names a local
        ``finetuned_from`` as a local checkpoint (the Trainer links ``huggingface.co/<local path>``), and puts
        ``metrics`` measured outside the Trainer (e.g. ``{"exact_match": 57.1, "f1": 57.3}``) into ``model-index``
        for the ``tasks`` and ``dataset`` given.
        """
        super().create_model_card(*args, **kwargs)
        if not self.is_world_process_zero():
            return
        path = os.path.join(self.args.output_dir, "README.md")
        if not os.path.exists(path):
            return
        opt = unwrap_optimizer(self.optimizer)
        communication = self.birder_args.communication()
        base = kwargs.get("finetuned_from") or getattr(getattr(self.model, "config", None), "_name_or_path", "") or ""
        fix_trainer_card(
            path,
            optimizer_line=f"- optimizer: {optimizer_description(opt, communication)}",
            section=model_card_section(opt, communication),
            base_model=base,
            metrics=metrics,
            task=kwargs.get("tasks"),
            dataset=kwargs.get("dataset"),
        )


def _topology(num_nodes: int | None, flag: str) -> Topology:
    """The launcher's layout (``None``), or its ranks split into ``num_nodes`` nodes (collective)."""
    if num_nodes is None:
        return Topology.from_env()
    import torch.distributed as dist

    world = dist.get_world_size()
    if world % num_nodes:
        raise ValueError(f"{flag} {num_nodes} does not divide the world size {world}.")
    return Topology.from_layout(num_nodes, world // num_nodes)


def _check_supported_setup(args, b: BirderArguments, trainer=None) -> None:
    """Refuse, at construction, the Trainer set-ups Birder cannot train correctly (``args``: the TrainingArguments;
    ``trainer``: once built, for what accelerate's config enabled)."""
    if args is None:
        return
    optim = getattr(args.optim, "value", args.optim)
    default = getattr(type(args), "__dataclass_fields__", {}).get("optim")
    default = getattr(default, "default", optim)
    if optim != getattr(default, "value", default):
        name = "OneBitAdam" if b.optimizer == "onebitadam" else "Birder"
        what = f"TrainingArguments.optim={optim!r}: BirderTrainer trains with {name} and would ignore it"
        raise ValueError(explain(what, f"Leave --optim at its default ({getattr(default, 'value', default)!r})"))
    if args.fp16 and b.optimizer == "onebitadam":
        what = "1-bit Adam cannot train with fp16 loss scaling (Adam's step depends on the scale)"
        raise ValueError(explain(what, "use --bf16 (Birder itself trains with --fp16)"))
    _refuse_framework_sharding(args, trainer, "BirderTrainer", "to shard use BirderArguments(sharding='hsdp')")


def _refuse_framework_sharding(args, trainer, who: str, fix: str) -> None:
    sharded = [
        name
        for name, on in (
            ("FSDP", bool(getattr(args, "fsdp", None)) or getattr(trainer, "is_fsdp_enabled", False)),
            ("DeepSpeed", bool(getattr(args, "deepspeed", None)) or getattr(trainer, "is_deepspeed_enabled", False)),
        )
        if on
    ]
    if sharded:
        what = f"{who} does not train with the Trainer's own {' or '.join(sharded)} (it bypasses the exchange)"
        raise ValueError(explain(what, f"drop --fsdp/--deepspeed; {fix}"))


class BirderTrainer(BirderTrainerMixin, Trainer):
    """``transformers.Trainer`` that trains with Birder and its 1-bit hook (see the module docstring)."""


# ------------------------------------------------------------------------------------------------- local steps
@dataclass
class LocalStepsArguments:
    """Local-step training (DiLoCo's outer loop, :class:`birder_hf.local_steps.LocalSteps`), parsed by
    ``HfArgumentParser`` next to ``TrainingArguments``; the inner optimizer is the Trainer's own (``--optim``)."""

    local_steps: int = field(
        default=0, metadata={"help": "Inner optimizer steps per outer step (DiLoCo's H); 0: every step all-reduces."}
    )
    outer_lr: float = field(default=0.7, metadata={"help": "The outer Nesterov step's learning rate."})
    outer_momentum: float = field(default=0.5, metadata={"help": "The outer Nesterov step's momentum (DiLoCo: 0.9)."})
    outer_exchange: str = field(
        default="onebit", metadata={"help": "onebit (Birder's 1-bit all-reduce) | fp32 (DiLoCo's all-reduce)."}
    )
    outer_encoding: str = field(
        default="sign", metadata={"help": "onebit only: sign (error feedback) | stochastic (unbiased, no feedback)."}
    )
    outer_scale_block: int | None = field(
        default=None, metadata={"help": "onebit only: elements per scale inside a tensor (None: one per tensor)."}
    )
    outer_method: str = field(
        default=DEFAULT_METHOD, metadata={"help": "onebit only: allgather | scatter_gather | hierarchical."}
    )
    outer_num_nodes: int | None = field(
        default=None,
        metadata={"help": "Nodes to split the ranks into (overrides LOCAL_WORLD_SIZE; simulates nodes on one host)."},
    )

    def __post_init__(self):
        if not (is_integer(self.local_steps) and self.local_steps >= 0):
            raise ValueError(f"Invalid local_steps={self.local_steps!r}: an int >= 1 (or 0: off).")
        if self.outer_num_nodes is not None and not (is_integer(self.outer_num_nodes) and self.outer_num_nodes >= 1):
            raise ValueError(f"Invalid outer_num_nodes={self.outer_num_nodes!r}: None or an int >= 1.")

    def build(self, model, optimizer) -> LocalSteps:
        """The :class:`LocalSteps` these arguments describe (collective: every rank must call it)."""
        topology = None if self.outer_num_nodes is None else _topology(self.outer_num_nodes, "--outer_num_nodes")
        return LocalSteps(
            model,
            optimizer,
            local_steps=self.local_steps,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            exchange=self.outer_exchange,
            encoding=self.outer_encoding,
            scale_block=self.outer_scale_block,
            method=self.outer_method,
            topology=topology,
        )


class LocalStepsCallback(TrainerCallback):
    """Builds the trainer's :class:`LocalSteps` (after DDP wrapping), loads this rank's own state on resume, counts
    every optimizer step and closes a partial round when training ends; installed by ``LocalStepsTrainerMixin``."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        opt = unwrap_optimizer(trainer.optimizer)
        if trainer.local_steps is None or trainer.local_steps.inner_optimizer is not opt:
            trainer.local_steps = trainer.local_args.build(trainer.model_wrapped, trainer.optimizer)
        if trainer._birder_resume_dir is not None:
            folder, rank, world = trainer._birder_resume_dir, args.process_index, args.world_size
            load_rank_state(trainer.local_steps, folder, rank=rank, world_size=world)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer.local_steps.step()

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.local_steps.finish()  # every rank ends with the same weights (a partial round exchanged)


class LocalStepsTrainerMixin(RankStateTrainerMixin):
    """Mix into any ``transformers.Trainer`` subclass (first in the bases) to train with local steps: each rank runs
    ``local_args.local_steps`` steps of the Trainer's own optimizer alone, then the ranks exchange the pseudo-gradient
    (1 bit per parameter by default) and take DiLoCo's outer step. Checkpoints hold every rank's own state and
    ``train(resume_from_checkpoint="auto")`` resumes from the newest complete one, as ``BirderTrainer``'s."""

    def __init__(self, *args, local_args: LocalStepsArguments, **kwargs):
        if not local_args.local_steps:
            raise ValueError(explain("LocalStepsTrainer with local_steps=0", "pass local_steps >= 1 (or use Trainer)"))
        super().__init__(*args, **kwargs)
        _refuse_framework_sharding(self.args, self, "LocalStepsTrainer", "local steps keep a whole model per rank")
        self.local_args = local_args
        self.local_steps: LocalSteps | None = None
        self.add_callback(LocalStepsCallback(self))

    def rank_state_owner(self):
        return self.local_steps

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.local_steps is not None and "loss" in logs:
            logs.update(self.local_steps.stats.as_dict("comm/"))
            logs["outer_steps"] = self.local_steps.outer_steps
        super().log(logs, *args, **kwargs)


class LocalStepsTrainer(LocalStepsTrainerMixin, Trainer):
    """``transformers.Trainer`` with local steps and a 1-bit outer exchange (:class:`LocalStepsTrainerMixin`)."""
