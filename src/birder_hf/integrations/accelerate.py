"""Birder with Hugging Face ``accelerate``: register the 1-bit hook after ``accelerator.prepare``.

::

    accelerator = Accelerator()
    model, optimizer, loader = accelerator.prepare(model, Birder(model.parameters(), lr=4e-3), loader)
    state = register_birder_hook(accelerator, model, optimizer, method="hierarchical")   # Birder:
    for batch in loader:
        with accelerator.accumulate(model):           # no_sync for the micro-batches before the last
            accelerator.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()
    accelerator.save_state(path)   # also writes every rank's Birder state (path/birder/)
    accelerator.load_state(path)   # and every rank loads its own

The same call registers ``onebit_adam_hook`` for a ``OneBitAdam`` optimizer (1-bit Adam, the paper's compressed
baseline), with the same per-rank checkpoints.

Sharded models (FSDP2, ``birder_hf.fsdp``): shard the model yourself with ``fully_shard(..., mesh=mesh["shard"])`` on a
2-D ``(replicate, shard)`` mesh, prepare only the optimizer and data loaders (accelerate refuses to wrap a sharded
model in DDP), then ``register_birder_hook(accelerator, model, optimizer, mesh=mesh)``: FSDP reduce-scatters inside
each node in full precision, Birder sends 1 bit across the nodes. accelerate's own FSDP plugin (GPUs only) shards on
its ``dp_shard`` dimension for plain FSDP (accepted: nothing crosses a replicate dimension, Birder runs uncompressed
with a warning) and on the 2-D ``(dp_replicate, dp_shard)`` mesh for HSDP, which all-reduces gradients across nodes
in full precision before Birder sees them: refused, with this recipe as the fix.

``accelerate``'s ``DistributedDataParallelKwargs(comm_hook=...)`` only takes its built-in hooks (a
callable is ignored), hence this function. ``mixed_precision="fp16"`` works: Birder takes the loss-scaled gradients
as they are, and an overflow on any rank skips the step everywhere (``optimizer.step_was_skipped``) and backs the
scale off (``birder_hf.communicators.HookState``); 1-bit Adam is refused with fp16.

Do not call ``accelerator.clip_grad_norm_`` with Birder: after the hook, ``.grad`` holds the direction ``d`` in
``[-1, 1]``, and each step moves a coordinate by at most ``lr * (1 + weight_decay * |x|)`` by construction (with fp16
it would also un-scale ``.grad``, which Birder refuses with an error).
"""

from __future__ import annotations

import logging
import os

from ..base import OneBitOptimizer, unwrap_optimizer
from ..checkpoint import read_own_rank_state, save_rank_state
from ..collectives import DEFAULT_INTER_METHOD, DEFAULT_METHOD, check_settings
from ..communicators import agree_setup, setup_group
from ..fsdp import register_birder_fsdp
from ..hook import attach_ddp_hook
from ..topology import Topology

__all__ = ["register_birder_hook", "check_really_distributed", "check_elastic_restart", "report_skipped_step"]

logger = logging.getLogger(__name__)


def check_really_distributed(num_processes: int) -> None:
    """Raise if the launcher started several processes that each believe they are alone.

    ``accelerate launch --multi_gpu`` on a machine without GPUs starts N processes that each run as
    rank 0 of 1 (silently undistributed). The launcher's WORLD_SIZE tells the truth.
    """
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if env_world > 1 and num_processes != env_world:
        raise RuntimeError(
            f"The launcher started WORLD_SIZE={env_world} processes but this one sees a world of {num_processes}: "
            "the processes are not really distributed. On CPU use `ACCELERATE_USE_CPU=1 accelerate launch "
            "--multi_gpu --num_processes N ...` or `torchrun --nproc_per_node N ...` (see accelerate_configs/)."
        )


def check_elastic_restart() -> None:
    """Raise, before the process group is set up, if torchrun restarted this worker on the store of the last attempt.

    torchrun's c10d rendezvous shares its TCPStore with the workers by default (``TORCHELASTIC_USE_AGENT_STORE=True``)
    and, in torch 2.14.1 (measured: ``tests/test_elastic.py``), keeps that store across restarts: a restarted worker
    reads the addresses the previous attempt's ranks published and the process group's setup fails after its connect
    timeouts, so every restart fails the same way (pytorch/pytorch#135712). With
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment each attempt gets a new store, and a restart
    resumes. Call this first in a script run
    with ``torchrun --max-restarts N`` (before ``TrainingArguments`` or ``Accelerator`` set up the process group).
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart not in ("", "0") and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RuntimeError(
            f"torchrun restarted this worker (TORCHELASTIC_RESTART_COUNT={restart}) on the store it shares across "
            "attempts (TORCHELASTIC_USE_AGENT_STORE=True): the process group would connect to the addresses of the "
            "previous attempt and fail (pytorch/pytorch#135712). Launch torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (every node)."
        )


def register_birder_hook(accelerator, model, optimizer, *, topology: Topology | None = None, mesh=None, **options):
    """Register the 1-bit hook on the DDP model that ``accelerator.prepare`` returned (or on an FSDP2-sharded model).

    Args:
        accelerator (`accelerate.Accelerator`): the accelerator that prepared ``model`` and ``optimizer``.
        model (`DistributedDataParallel`): the model returned by ``prepare`` (``torch.compile``-d or not).
        optimizer (`Birder` or `OneBitAdam`, or accelerate's wrapper of it): the prepared optimizer; a
            ``OneBitAdam`` gets ``onebit_adam_hook``.
        topology (`Topology`, *optional*): DDP: defaults to ``Topology.from_env()`` (the launcher's node layout).
        mesh (`DeviceMesh`, *optional*): FSDP2: the 2-D ``(replicate, shard)`` mesh the model was sharded on
            (:func:`birder_hf.fsdp.register_birder_fsdp`); default: the mesh of the model's parameters.
        **options: the hook's settings, as :func:`birder_hf.attach_ddp_hook` takes them: ``method`` (default
            ``"hierarchical"``), ``inter_method``, ``chunk_numel``, ``check_finite``, ``grad_scaler`` (default:
            ``accelerator.scaler``, the fp16 loss scaler, whose scale the hook divides out).

    Returns:
        The hook state (its ``stats`` hold the bytes sent), or ``None`` in a single process, where
        there is no communication to compress.

    Also registers ``save_state``/``load_state`` hooks that write and read every rank's own optimizer
    state (``birder_hf.checkpoint``).
    """
    inner = unwrap_optimizer(optimizer)
    error = None
    try:
        if not isinstance(inner, OneBitOptimizer):
            raise TypeError(
                f"register_birder_hook needs a birder_hf.Birder (or OneBitAdam) optimizer, got {type(inner).__name__}."
            )
        _check_options(**options)
        check_really_distributed(accelerator.num_processes)
        handler = getattr(accelerator, "ddp_handler", None)
        builtin = getattr(handler, "comm_hook", None)
        if builtin is not None and str(getattr(builtin, "value", builtin)).lower() not in ("no", "none"):
            raise ValueError(
                f"DistributedDataParallelKwargs(comm_hook={builtin}) already asks for a built-in hook; DDP allows "
                "one hook per model. Drop comm_hook from the kwargs handler to use Birder's 1-bit hook."
            )
        if not inner.loss_scaling and getattr(accelerator, "scaler", None) is not None:
            raise ValueError(
                "1-bit Adam cannot train with fp16 loss scaling (accelerate's GradScaler): its hook encodes the "
                "scaled gradients, and Adam's step depends on their scale. Use mixed_precision='bf16' (Birder itself "
                "trains with fp16)."
            )
    except Exception as exc:
        error = exc
    # a bad argument on one rank stops every rank here, before Topology.from_env and the hook's own collectives
    # (the others would wait in them until the process-group timeout); one small all-gather at set-up
    agree_setup(setup_group(topology), {} if error is None else None, error, what="register_birder_hook")
    if inner.loss_scaling:
        options.setdefault("grad_scaler", getattr(accelerator, "scaler", None))
    if accelerator.num_processes == 1:
        _register_checkpoint_hooks(accelerator, inner)
        logger.info("%s: single process, no gradient communication to compress.", type(inner).__name__)
        return None
    sharded = next((p for p in model.parameters() if hasattr(p, "device_mesh")), None)
    if sharded is not None:
        if topology is not None:
            raise ValueError(
                "topology= is for DDP; for an FSDP2-sharded model pass mesh= (the (replicate, shard) mesh)."
            )
        state = register_birder_fsdp(model, inner, mesh if mesh is not None else sharded.device_mesh, **options)
        _register_checkpoint_hooks(accelerator, inner)
        logger.info("%s: %s registered.", type(inner).__name__, state.description)
        return state
    if mesh is not None:
        raise ValueError("mesh= is for FSDP2-sharded models; this model is not sharded (DDP takes topology=).")
    state = attach_ddp_hook(model, inner, topology=topology or Topology.from_env(), **options)
    _register_checkpoint_hooks(accelerator, inner)
    logger.info("%s: %s registered on %r.", type(inner).__name__, state.description, state.topology)
    return state


def report_skipped_step(optimizer, skipped: bool) -> None:
    """Tell accelerate that ``optimizer``'s last step was skipped (``Accelerator.optimizer_step_was_skipped``, which
    the Trainer and ``AcceleratedScheduler`` read to hold the learning-rate schedule back).

    accelerate only knows the steps a ``GradScaler`` skipped (``AcceleratedOptimizer.step_was_skipped``); a step Birder
    skipped itself (a rank had a non-finite gradient, without a scaler) is set here on the same flag. With a scaler,
    accelerate's own answer stands unless Birder skipped. Call it after ``optimizer.step()``.
    """
    if not hasattr(optimizer, "step_was_skipped") or not hasattr(optimizer, "_is_overflow"):
        return  # not accelerate's AcceleratedOptimizer
    if getattr(optimizer, "scaler", None) is None:
        optimizer._is_overflow = bool(skipped)  # accelerate sets it only in its scaler branch
    elif skipped:
        optimizer._is_overflow = True


def _check_options(method: str = DEFAULT_METHOD, inter_method: str = DEFAULT_INTER_METHOD, **others) -> None:
    # refuse a bad setting at once, in every process (one process registers no hook)
    unknown = set(others) - {"chunk_numel", "check_finite", "grad_scaler"}
    if unknown:
        raise TypeError(f"register_birder_hook got unknown options {sorted(unknown)}; see birder_hf.attach_ddp_hook.")
    check_settings(method, inter_method, others.get("chunk_numel"))


def _register_checkpoint_hooks(accelerator, optimizer: OneBitOptimizer) -> None:
    def save_pre_hook(models, weights, output_dir):
        save_rank_state(optimizer, output_dir, rank=accelerator.process_index, world_size=accelerator.num_processes)

    def load_pre_hook(models, input_dir):
        # accelerate loads rank 0's optimizer state into every rank right after this hook; stage this rank's own
        # every rank together: one rank's missing or corrupt file stops them all at once
        state = read_own_rank_state(
            optimizer, input_dir, rank=accelerator.process_index, world_size=accelerator.num_processes
        )
        optimizer.stage_rank_state(state)

    accelerator.register_save_state_pre_hook(save_pre_hook)
    accelerator.register_load_state_pre_hook(load_pre_hook)
