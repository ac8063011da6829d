"""Birder with the Hugging Face ``Trainer``: ``BirderTrainer`` (or ``BirderTrainerMixin`` for your subclass).

One line for users: ``Trainer(...)`` becomes ``BirderTrainer(..., birder_args=BirderArguments())``.

Why a subclass and not only a callback: a ``TrainerCallback`` sees the unwrapped model, not the DDP
module the hook must be registered on, and it cannot put numbers into the logs that TensorBoard and
friends receive, nor learn which checkpoint a resume starts from. The subclass uses the public seams
``create_optimizer`` (Birder by default), ``train`` (remembers ``resume_from_checkpoint``),
``log`` (adds communication statistics), ``create_model_card`` (names Birder), plus a callback it
installs itself for ``on_train_begin`` (after DDP wrapping and the framework's optimizer load: registers
the hook, loads this rank's own Birder state) and ``on_optimizer_step`` (tells the Trainer when Birder skipped a
step), and two protected methods of the Trainer: ``_save_optimizer_and_scheduler(output_dir)`` (writes every rank's
Birder state into the very folder the Trainer saves to, ``run-*/checkpoint-N`` in a hyperparameter search) and
``_get_grad_norm`` (see below).
For your own Trainer subclass: ``class MyTrainer(BirderTrainerMixin, Seq2SeqTrainer): ...``.
``optimizer_cls_and_kwargs=(Birder, {...})`` and ``optimizers=(Birder(...), None)`` work too.

What it changes, on purpose:
- ``max_grad_norm``: the Trainer would clip ``.grad`` after backward, which with the hook holds the
  direction ``d`` in ``[-1, 1]`` (each step moves a coordinate by at most ``lr * (1 + weight_decay * |x|)``, by
  construction); clipping it is meaningless, so a positive ``max_grad_norm`` (default 1.0) is set to 0 with a
  warning.
- ``grad_norm`` is not logged: the Trainer would log the norm of ``.grad``, which holds ``d`` after the hook, and with
  fp16 it would un-scale ``.grad`` to compute it.
- a step Birder skipped (a rank had a non-finite gradient) is reported to the Trainer as skipped, as a ``GradScaler``
  overflow is: the learning-rate scheduler does not advance.
- ``fp16`` trains with loss scaling (Birder's ``u = m / b`` does not depend on the scale; see
  ``birder_hf.communicators.HookState``); 1-bit Adam is refused with ``fp16`` (use ``bf16``).
- FSDP and DeepSpeed are refused at construction: sharded training with Birder is tracked in birder-hf issue 15.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from ..base import OneBitOptimizer, unwrap_optimizer
from ..checkpoint import read_rank_state, save_rank_state
from ..collectives import DEFAULT_INTER_METHOD, DEFAULT_METHOD, INTER_METHODS, METHODS
from ..communicators import HookState
from ..hook import attach_ddp_hook
from ..model_card import fix_trainer_card, model_card_section, optimizer_description
from ..onebit_adam import OneBitAdam
from ..optim import Birder
from ..topology import Topology
from .accelerate import check_really_distributed, report_skipped_step

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "birder_hf.integrations.transformers needs transformers: pip install 'birder-hf[transformers]'"
    ) from exc

__all__ = ["BirderArguments", "BirderTrainerMixin", "BirderTrainer", "BirderCallback", "birder_model_card_section"]

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
    quantize: bool = field(
        default=True, metadata={"help": "Binary randomization; False sends u itself (one process only, a reference)."}
    )
    num_nodes: int | None = field(
        default=None,
        metadata={
            "help": "Override the launcher's node layout (LOCAL_WORLD_SIZE): split the ranks into this many nodes, "
            "e.g. --num_nodes 2 with 4 processes on one machine simulates 2 nodes x 2 for the hierarchical method."
        },
    )
    comm_method: str | None = field(default=None, metadata={"help": "Deprecated name of --method."})

    optimizers: ClassVar[tuple[str, ...]] = OPTIMIZERS  # a recipe's subclass may add its uncompressed baselines

    def __post_init__(self):
        if self.comm_method is not None:
            warnings.warn("BirderArguments(comm_method=...) is renamed method=...", FutureWarning, stacklevel=3)
            self.method, self.comm_method = self.comm_method, None
        if self.optimizer not in self.optimizers:
            raise ValueError(f"optimizer={self.optimizer!r}; choose one of {', '.join(self.optimizers)}.")
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}; choose one of {', '.join(METHODS)}.")
        if self.inter_method not in INTER_METHODS:
            raise ValueError(f"inter_method={self.inter_method!r}; choose one of {', '.join(INTER_METHODS)}.")
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"beta={self.beta} must lie in [0, 1).")

    def topology(self) -> Topology:
        """The topology these arguments ask for (collective: every rank must call it)."""
        if self.num_nodes is None:
            return Topology.from_env()
        import torch.distributed as dist

        world = dist.get_world_size()
        if world % self.num_nodes:
            raise ValueError(f"--num_nodes {self.num_nodes} does not divide the world size {world}.")
        return Topology.from_layout(self.num_nodes, world // self.num_nodes)

    def communication(self) -> dict:
        """Birder's all-reduce settings, as listed in model cards."""
        out = {"method": self.method, "inter_method": self.inter_method, "chunk_numel": self.chunk_numel}
        if self.num_nodes is not None:
            out["num_nodes"] = self.num_nodes
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
            # the Trainer just loaded rank 0's optimizer.pt into every rank; take this rank's own state
            opt.load_state_dict(
                read_rank_state(trainer._birder_resume_dir, rank=args.process_index, world_size=args.world_size)
            )
        check_really_distributed(args.world_size)
        hooked = trainer.birder_hook_state
        if args.world_size == 1 or (hooked is not None and hooked.optimizer is opt):
            return
        # a new optimizer (first train(), or a new trial of hyperparameter_search / model_init): a new hook, on the
        # new DDP model; the previous one's process groups are released first
        if hooked is not None:
            hooked.close()
        b = trainer.birder_args
        trainer.birder_hook_state = attach_ddp_hook(
            trainer.model_wrapped,
            opt,
            topology=b.topology(),
            method=b.method,
            inter_method=b.inter_method,
            chunk_numel=b.chunk_numel,
        )
        state = trainer.birder_hook_state
        logger.info("%s: %s registered on %r", type(opt).__name__, state.description, state.topology)

    def on_optimizer_step(self, args, state, control, **kwargs):
        # the Trainer steps the LR scheduler unless accelerate reports the optimizer step as skipped
        opt = unwrap_optimizer(self.trainer.optimizer)
        report_skipped_step(self.trainer.optimizer, getattr(opt, "step_was_skipped", False))


class BirderTrainerMixin:
    """Mix into any ``transformers.Trainer`` subclass (first in the bases) to train with Birder."""

    def __init__(self, *args, birder_args: BirderArguments | None = None, **kwargs):
        birder_args = birder_args if birder_args is not None else BirderArguments()
        if birder_args.optimizer not in OPTIMIZERS:
            raise ValueError(f"BirderArguments.optimizer={birder_args.optimizer!r}; choose birder or onebitadam.")
        _check_supported_setup(
            kwargs["args"] if "args" in kwargs else (args[1] if len(args) > 1 else None), birder_args
        )
        super().__init__(*args, **kwargs)
        self.birder_args = birder_args
        self.birder_hook_state: HookState | None = None
        self._birder_resume_dir: str | None = None
        _check_supported_setup(self.args, birder_args, self)
        if self.args.max_grad_norm and self.args.max_grad_norm > 0:
            logger.warning(
                "Birder: max_grad_norm=%s set to 0. After the 1-bit hook, .grad holds the direction d in [-1, 1] "
                "(a step moves a coordinate by at most lr * (1 + weight_decay * |x|)); clipping it is meaningless.",
                self.args.max_grad_norm,
            )
            self.args.max_grad_norm = 0.0
        self.add_callback(BirderCallback(self))

    def create_optimizer(self, model=None):
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None:
            a, b = self.args, self.birder_args
            if b.optimizer == "onebitadam":
                cls, extra = (
                    OneBitAdam,
                    dict(betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_epsilon, freeze_step=b.freeze_step),
                )
            else:
                cls, extra = Birder, dict(beta=b.beta, amsgrad=b.amsgrad, quantize=b.quantize, seed=a.seed)
            self.optimizer_cls_and_kwargs = (cls, dict(lr=a.learning_rate, weight_decay=a.weight_decay, **extra))
        return super().create_optimizer(model) if model is not None else super().create_optimizer()

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No checkpoint found in {self.args.output_dir} to resume from.")
        self._birder_resume_dir = resume_from_checkpoint or None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # every rank, into the folder the Trainer saves this checkpoint to (a trial's run-*/checkpoint-N included)
        super()._save_optimizer_and_scheduler(output_dir)
        save_rank_state(self.optimizer, output_dir, rank=self.args.process_index, world_size=self.args.world_size)

    def _get_grad_norm(self, model, grad_norm=None):
        # after the hook .grad holds d, whose norm says nothing about the gradient, and with fp16 the Trainer's
        # norm would un-scale .grad (GradScaler.unscale_); log no norm
        return grad_norm

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        state = self.birder_hook_state
        if state is not None and "loss" in logs and state.steps_communicated:
            prefix = "birder/" if isinstance(state.optimizer, Birder) else "onebit_adam/"
            logs.update(state.stats.as_dict(prefix))
            logs[prefix + "skipped_steps"] = state.skipped_steps
            if isinstance(state.optimizer, OneBitAdam):
                logs[prefix + "compressed_steps"] = state.compressed_steps
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


def _check_supported_setup(args, b: BirderArguments, trainer=None) -> None:
    """Refuse, at construction, the Trainer set-ups Birder cannot train correctly (``args``: the TrainingArguments;
    ``trainer``: once built, for what accelerate's config enabled)."""
    if args is None:
        return
    if args.fp16 and b.optimizer == "onebitadam":
        raise ValueError(
            "1-bit Adam cannot train with fp16 loss scaling: its hook encodes the scaled gradients, and Adam's step "
            "depends on their scale. Use --bf16 (Birder itself trains with --fp16)."
        )
    sharded = [
        name
        for name, on in (
            ("FSDP", bool(getattr(args, "fsdp", None)) or getattr(trainer, "is_fsdp_enabled", False)),
            ("DeepSpeed", bool(getattr(args, "deepspeed", None)) or getattr(trainer, "is_deepspeed_enabled", False)),
        )
        if on
    ]
    if sharded:
        # sharded training (FSDP2/HSDP) gets its own seam (birder-hf issue 15); this check is the one to replace
        raise ValueError(
            f"BirderTrainer does not support {' or '.join(sharded)} yet: the 1-bit hook needs plain DDP, where every "
            "rank holds the whole model. Drop --fsdp/--deepspeed (and the accelerate config's FSDP/DeepSpeed plugin); "
            "sharded training with Birder is tracked in birder-hf issue 15."
        )


class BirderTrainer(BirderTrainerMixin, Trainer):
    """``transformers.Trainer`` that trains with Birder and its 1-bit hook (see the module docstring)."""


def birder_model_card_section(opt, b: BirderArguments) -> str:
    """Deprecated: ``birder_hf.model_card.model_card_section(opt, b.communication())``."""
    return model_card_section(opt, b.communication())
