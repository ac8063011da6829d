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
    accelerator.save_state(path)   # also writes every rank's Birder state (path/birder/), then the completion marker
    accelerator.load_state(path)   # and every rank loads its own

Local steps (DiLoCo's outer loop on the 1-bit exchange, in the spirit of accelerate's ``LocalSGD``), with the
framework's own optimizer::

    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters()), loader)
    with local_steps(accelerator, model, optimizer, local_steps=50) as local:   # nothing crosses the wire ...
        for batch in loader:
            accelerator.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()
            local.step()                              # ... but every 50th step's 1-bit exchange and outer step

After a restart (``torchrun --max-restarts N``), ``load_resumable_state(accelerator, folder)`` loads the newest
checkpoint under ``folder`` that is complete on every rank, or starts fresh.

The same call registers ``onebit_adam_hook`` for a ``OneBitAdam`` optimizer, and the FSDP hook for a model sharded
with ``fully_shard(..., mesh=mesh["shard"])`` (pass ``mesh=``; prepare only the optimizer and data loaders).
``DistributedDataParallelKwargs(comm_hook=...)`` only takes accelerate's built-in hooks (a callable is ignored), hence
this function. fp16, accelerate's FSDP plugin (HSDP refused), and why not to call ``accelerator.clip_grad_norm_``:
``docs/SETUPS.md`` ("accelerate", "Sharded training: 1-bit HSDP").
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil

from ..base import OneBitOptimizer, explain, unwrap_optimizer
from ..checkpoint import read_own_rank_state, save_rank_state
from ..communicators import agree_setup, setup_group
from ..elastic import (
    claim_output_dir,
    clear_completion_marker,
    find_resumable_checkpoint,
    mark_checkpoint_complete,
    numbered_checkpoints,
    on_rank_zero,
)
from ..fsdp import register_birder_fsdp
from ..hook import attach_ddp_hook
from ..local_steps import LocalSteps
from ..settings import DEFAULT_INTER_METHOD, DEFAULT_METHOD, check_settings
from ..topology import Topology

__all__ = [
    "register_birder_hook",
    "local_steps",
    "load_resumable_state",
    "check_really_distributed",
    "check_elastic_restart",
    "report_skipped_step",
]

logger = logging.getLogger(__name__)

# accelerate's automatic naming (checkpoint_N) and the usual hand-made names (checkpoint-N, step_N, epoch_N): letters,
# "_" or "-", then the number in ASCII digits without a leading zero (accelerate's own load_state() orders its
# checkpoints by that number too). Not a checkpoint: logs20240101, step_0100, checkpoint-١٢
_NUMBERED = re.compile(r"^([A-Za-z]+[_-])(0|[1-9][0-9]*)$")


def check_really_distributed(num_processes: int) -> None:
    """Raise if the launcher started several processes that each believe they are alone.

    ``accelerate launch --multi_gpu`` on a machine without GPUs starts N processes that each run as
    rank 0 of 1 (silently undistributed). The launcher's WORLD_SIZE tells the truth.
    """
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if env_world > 1 and num_processes != env_world:
        what = f"WORLD_SIZE={env_world} processes were started, this one sees {num_processes}: not really distributed"
        raise RuntimeError(explain(what, "on CPU use ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu, or torchrun"))


def check_elastic_restart() -> None:
    """Raise, before the process group is set up, if torchrun restarted this worker on the store of the last attempt.

    torchrun's c10d rendezvous shares its TCPStore with the workers by default and, in torch 2.14.1
    (``tests/test_elastic.py``), keeps it across restarts: a restarted worker's process group setup then fails every
    time (pytorch/pytorch#135712); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each attempt a new store. Call this
    first in a script run with ``torchrun --max-restarts N``, before the process group is set up.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart not in ("", "0") and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        what = (
            f"torchrun restarted (TORCHELASTIC_RESTART_COUNT={restart}) on a shared store: "
            "init_process_group would fail (pytorch/pytorch#135712)"
        )
        raise RuntimeError(explain(what, "Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (every node)"))


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
        The hook state (its ``stats`` hold the bytes sent), or ``None`` in a single process.

    Also makes ``save_state``/``load_state`` write and read every rank's own optimizer state, and ``save_state`` mark
    each checkpoint complete once every rank has written it (for :func:`load_resumable_state`).
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
            what = f"DistributedDataParallelKwargs(comm_hook={builtin}) asks for a built-in hook, and DDP allows one"
            raise ValueError(explain(what, "drop comm_hook from the kwargs handler"))
        if not inner.loss_scaling and getattr(accelerator, "scaler", None) is not None:
            raise ValueError(
                explain("1-bit Adam cannot train with fp16 loss scaling", "use mixed_precision='bf16' (or Birder)")
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


def local_steps(accelerator, model, optimizer, *, local_steps: int, **options) -> LocalSteps:
    """Train ``model`` with local steps: :class:`birder_hf.local_steps.LocalSteps` on what ``accelerator.prepare``
    returned (DDP's gradient all-reduce switched off); call its ``step()`` after every ``optimizer.step()``.

    ``options`` are :class:`LocalSteps`' (``outer_lr``, ``outer_momentum``, ``exchange``, ``encoding``, ``topology``,
    ``method``, ``inter_method``, ``seed``). Also makes ``save_state`` write every rank's own state (its weights, inner
    optimizer state, outer weights and momentum, error buffers) and mark the checkpoint complete once every rank has,
    and ``load_state`` (or :func:`load_resumable_state`) restore this rank's own after accelerate's loads.
    """
    check_really_distributed(accelerator.num_processes)
    local = LocalSteps(model, optimizer, local_steps=local_steps, **options)
    rank, world = accelerator.process_index, accelerator.num_processes
    staged = {}

    def save_pre_hook(models, weights, output_dir):
        save_rank_state(local, output_dir, rank=rank, world_size=world)

    def load_pre_hook(models, input_dir):  # every rank together: one rank's bad file stops them all at once
        staged["state"] = read_own_rank_state(local, input_dir, rank=rank, world_size=world)

    accelerator.register_save_state_pre_hook(save_pre_hook)
    accelerator.register_load_state_pre_hook(load_pre_hook)
    _mark_saves_complete(accelerator)
    original = accelerator.load_state

    @functools.wraps(original)
    def load_state(*args, **kwargs):
        # accelerate loads rank 0's weights and optimizer state into every rank after the pre-hooks: this rank's own
        # state goes back in after them
        result = original(*args, **kwargs)
        if "state" in staged:
            local.load_state_dict(staged.pop("state"))
        return result

    accelerator.load_state = load_state
    return local


def report_skipped_step(optimizer, skipped: bool) -> None:
    """Tell accelerate that ``optimizer``'s last step was skipped (``Accelerator.optimizer_step_was_skipped``, which
    the Trainer and ``AcceleratedScheduler`` read to hold the learning-rate schedule back).

    accelerate only knows the steps a ``GradScaler`` skipped; a step Birder skipped itself is set here on the same
    flag. Call it after ``optimizer.step()``.
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


def load_resumable_state(accelerator, checkpoints_dir: str | os.PathLike | None = None, **load_kwargs) -> str | None:
    """Load the newest checkpoint under ``checkpoints_dir`` that is complete on every rank; return its path, or
    ``None`` (nothing loaded: a fresh start).

    What a script run with ``torchrun --max-restarts N`` calls after ``prepare`` and :func:`register_birder_hook`, in
    place of ``accelerator.load_state(...)``::

        path = load_resumable_state(accelerator)           # ProjectConfiguration(automatic_checkpoint_naming=True)
        path = load_resumable_state(accelerator, "out")    # out/step_100, out/step_200, ... (letters, _ or -, N)

    Args:
        accelerator (`accelerate.Accelerator`): the accelerator :func:`register_birder_hook` was called with (its
            ``save_state`` writes the completion marker).
        checkpoints_dir (`str`, *optional*): the folder holding the checkpoint folders. Default, with
            ``ProjectConfiguration(automatic_checkpoint_naming=True)``: ``project_dir/checkpoints``.
        **load_kwargs: passed to ``accelerator.load_state``.

    The checkpoints are the sub-folders named letters, ``_`` or ``-``, then a number in ASCII digits without a leading
    zero, of one naming scheme (two raise ``ValueError``), highest first (as accelerate orders them); the
    first one marked complete (``birder_hf.elastic.checkpoint_problem``) is loaded, newer incomplete ones are named
    in a warning. With automatic naming, the next ``save_state`` goes after the highest number present (accelerate
    would write ``checkpoint_0`` again). Collective: rank 0's choice is every rank's.
    """
    config = accelerator.project_configuration
    if checkpoints_dir is None:
        if not config.automatic_checkpoint_naming:
            what = "load_resumable_state needs the folder that holds the checkpoints"
            raise ValueError(explain(what, "pass checkpoints_dir=..., or use automatic_checkpoint_naming=True"))
        checkpoints_dir = os.path.join(accelerator.project_dir, "checkpoints")
    folder = os.path.expanduser(os.fspath(checkpoints_dir))
    _claim(accelerator, folder)
    _check_one_naming(folder)
    path = find_resumable_checkpoint(folder, pattern=_NUMBERED)
    automatic = os.path.join(accelerator.project_dir or "", "checkpoints")
    if config.automatic_checkpoint_naming and _same(folder, automatic):
        # rank 0's listing: every rank must name the next checkpoint alike
        last = on_rank_zero(lambda: max((n for n, _ in numbered_checkpoints(folder, _NUMBERED)), default=-1))
        config.iteration = max(config.iteration, last + 1)
    if path is not None:
        accelerator.load_state(path, **load_kwargs)
    return path


def _check_one_naming(folder: str) -> None:
    # the numbers of two naming schemes (an older run's step_100 beside this one's checkpoint_1) say nothing of age
    names = {}
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            m = _NUMBERED.match(name)
            if m and os.path.isdir(os.path.join(folder, name)):
                names.setdefault(m.group(1), name)
    if len(names) > 1:
        listed = ", ".join(names.values())
        what = f"{folder} holds checkpoints named in {len(names)} ways ({listed}), whose numbers say nothing of age"
        raise ValueError(explain(what, "keep one naming scheme in the folder (move the others away)"))


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
    _mark_saves_complete(accelerator)


def _mark_saves_complete(accelerator) -> None:
    # accelerate 1.15 has no hook after save_state writes its files (its pre-hooks run before them), so this
    # accelerator's save_state is wrapped (an instance attribute; the class is untouched), once
    original = accelerator.save_state
    if getattr(original, "_birder_marks_complete", False):
        return

    @functools.wraps(original)
    def save_state(output_dir=None, *args, **kwargs):
        config = accelerator.project_configuration
        automatic = config.automatic_checkpoint_naming
        if automatic:  # where accelerate will save (it refuses an existing folder)
            folder = os.path.join(accelerator.project_dir, "checkpoints", f"checkpoint_{accelerator.save_iteration}")
        else:
            folder = None if output_dir is None else os.path.expanduser(os.fspath(output_dir))
        if folder is None:
            return original(output_dir, *args, **kwargs)  # accelerate's own error, on every rank
        _claim(accelerator, os.path.dirname(folder))
        if not automatic:  # (automatic naming refuses an existing folder)
            clear_completion_marker(folder)  # every rank, before it writes: no marker covers a file being rewritten
        # old checkpoints are rotated away after the new one is marked, not before accelerate writes it
        limit = config.total_limit if automatic else None
        failure, location = None, None
        try:
            if limit is not None:
                config.total_limit = None
            location = original(output_dir, *args, **kwargs)
        except Exception as exc:  # every rank still joins the marker's all-gather, which then fails everywhere
            failure = exc
        finally:
            if limit is not None:
                config.total_limit = limit
        writer = _writes_checkpoints(accelerator)
        mark_checkpoint_complete(
            folder, rank=accelerator.process_index, world_size=accelerator.num_processes, write=writer, failed=failure
        )
        if limit is not None and accelerator.is_main_process:
            _rotate(os.path.dirname(folder), limit)
        return location

    save_state._birder_marks_complete = True
    accelerator.save_state = save_state


def _claim(accelerator, checkpoints_dir: str) -> None:
    # this job's checkpoints folder (automatic naming: the project folder, so that no lock file sits among the
    # checkpoint folders accelerate lists by number), claimed by the ranks that write there, on every rank together
    automatic = os.path.join(accelerator.project_dir or "", "checkpoints")
    if accelerator.project_configuration.automatic_checkpoint_naming and _same(checkpoints_dir, automatic):
        checkpoints_dir = accelerator.project_dir
    holder = _writes_checkpoints(accelerator)
    claim_output_dir(checkpoints_dir or ".", holder=holder, world_size=accelerator.num_processes)


def _writes_checkpoints(accelerator) -> bool:
    # the ranks whose disk accelerate's save_state writes to: each node's first with save_on_each_node, else rank 0
    on_each_node = accelerator.project_configuration.save_on_each_node
    return accelerator.is_local_main_process if on_each_node else accelerator.is_main_process


def _same(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _rotate(parent: str, limit: int) -> None:
    # accelerate's total_limit: keep the newest `limit` checkpoints (by number), now that the newest is complete
    for _, path in numbered_checkpoints(parent, _NUMBERED)[max(limit, 1) :]:
        logger.info("Removing %s (ProjectConfiguration(total_limit=%d)).", path, limit)
        shutil.rmtree(path, ignore_errors=True)
