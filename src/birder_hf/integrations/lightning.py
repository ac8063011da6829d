"""Birder with PyTorch Lightning: ``Trainer(strategy=BirderDDPStrategy(method="hierarchical"))``.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB

The LightningModule returns a :class:`birder_hf.Birder` (or :class:`birder_hf.OneBitAdam`) from
``configure_optimizers``; the strategy does the rest::

    trainer = Trainer(accelerator="gpu", devices=8, num_nodes=4, strategy=BirderDDPStrategy(method="hierarchical"))
    trainer.fit(model)                      # the 1-bit hierarchical all-reduce, 4 nodes x 8
    trainer.fit(model, ckpt_path="last")    # every rank resumes from its own Birder state
    # after an elastic restart: the newest checkpoint complete on every rank, or None (a fresh start)
    trainer.fit(model, ckpt_path=find_resumable_lightning_checkpoint("checkpoints/"))

Why a strategy subclass: ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` registers the hook while it
wraps the model, before ``configure_optimizers`` runs (and, in Lightning 2.6, only on CUDA), so a hook state
that needs the optimizer cannot be passed there. ``BirderDDPStrategy.setup`` registers the 1-bit hook right
after Lightning's own setup, once the optimizer exists, on CPU (gloo) and CUDA (NCCL) alike. The seams it
uses are public ``Strategy`` methods:

- ``setup``: refuses what cannot work (below), builds the topology from Lightning's own view
  (``num_nodes`` x ``devices``, node-major ranks) and registers ``birder_hook`` / ``onebit_adam_hook``;
- ``optimizer_step``: logs the communication statistics (``birder/bytes_sent``, ``birder/compression_ratio``,
  ...; ``onebit_adam/...`` for 1-bit Adam) through ``LightningModule.log``, so every Lightning logger gets them;
- ``save_checkpoint`` / ``remove_checkpoint``: Lightning writes rank 0's optimizer state only; every rank also
  writes its own Birder state beside the checkpoint, in ``<checkpoint>.birder/`` (``birder_state_dir``), removed with
  the checkpoint; once every rank has written, rank 0 marks it complete (``birder_complete.json``, listing the
  ``.ckpt`` too);
- ``load_checkpoint`` / ``load_optimizer_state_dict``: after Lightning loaded rank 0's optimizer state into
  every rank, each rank loads its own, so ``fit(ckpt_path=...)`` continues bit for bit. A checkpoint without
  that folder, or not complete, is refused on every rank before any state loads (never a silent reset).

fp16 (``"16-mixed"``) and ``accumulate_grad_batches`` work; what is refused at setup (each with the fix), and why:
``docs/SETUPS.md`` ("PyTorch Lightning"). Other strategies (``"ddp"``, FSDP, DeepSpeed) have no 1-bit path: with
``strategy="ddp"`` Birder trains on fp32 all-reduced gradients and warns once.

Local checkpoints only: the per-rank files are written with plain file I/O (a local or mounted directory);
Lightning's ``.ckpt`` itself may go anywhere its ``CheckpointIO`` supports.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from ..base import OneBitOptimizer, explain
from ..checkpoint import MARKER, read_own_rank_state, save_rank_state
from ..communicators import HookState
from ..elastic import (
    check_search_folder,
    checkpoint_problem,
    checkpoint_step,
    claim_output_dir,
    clear_completion_marker,
    mark_checkpoint_complete,
)
from ..hook import BirderHookState, attach_ddp_hook
from ..onebit_adam import OneBitAdam
from ..optim import Birder
from ..settings import DEFAULT_INTER_METHOD, DEFAULT_METHOD, check_settings
from ..together import gather, world_group
from ..topology import Topology
from . import needs_extra

with needs_extra(__name__, "PyTorch Lightning", "lightning"):
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

__all__ = ["BirderDDPStrategy", "birder_state_dir", "find_resumable_lightning_checkpoint"]


def birder_state_dir(checkpoint_path: str | os.PathLike) -> str:
    """The folder that holds every rank's Birder state for the Lightning checkpoint ``checkpoint_path``.

    ``epoch=3-step=80.ckpt`` -> ``epoch=3-step=80.ckpt.birder`` (files inside: ``birder/rank_RRRRR-of-WWWWW.pt``).
    A symlinked checkpoint (``ModelCheckpoint(save_last="link")``) resolves to its target first.
    """
    path = os.fspath(checkpoint_path)
    if "://" in path:
        what = f"BirderDDPStrategy writes each rank's state with local file I/O, but {path!r} is a remote URL"
        raise ValueError(
            explain(what, "save checkpoints to a local or mounted directory (ModelCheckpoint(dirpath=...))")
        )
    return os.path.realpath(path) + ".birder"


def _lightning_checkpoint_problem(checkpoint_path: str) -> str | None:
    # why a Lightning checkpoint cannot be resumed from: its .ckpt, or every rank's Birder file, not all there
    if not os.path.exists(checkpoint_path):
        return "the .ckpt is missing (a link to a removed checkpoint, or rank 0 died before writing it)"
    return checkpoint_problem(birder_state_dir(checkpoint_path))


def find_resumable_lightning_checkpoint(dirpath: str | os.PathLike) -> str | None:
    """The newest ``.ckpt`` in ``dirpath`` (``ModelCheckpoint(dirpath=...)``) that is complete on every rank, or
    ``None``: pass it as ``trainer.fit(model, ckpt_path=...)`` (``None`` starts fresh).

    Complete: its ``<name>.ckpt.birder/birder_complete.json`` is there and every file it lists has the size it lists.
    Newest: the highest training step recorded in that marker when it was written (names such as ``last.ckpt`` carry
    none, and file times change with a copy or a ``touch``); checkpoints marked before steps were recorded come after,
    by time. Incomplete ones (no marker) are named in a warning and left alone. Reads only the file system (call it
    before ``fit``); the strategy refuses to resume ranks that disagree.
    """
    folder = os.fspath(dirpath)
    if "://" in folder:
        birder_state_dir(folder)  # the remote-URL error
    check_search_folder(folder)  # a .ckpt given for its folder
    found = {}
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.endswith(".ckpt.birder") and os.path.isdir(path):
                name, path = name[: -len(".birder")], path[: -len(".birder")]  # its .ckpt may be missing
            elif not name.endswith(".ckpt"):
                continue
            times = []
            for part in (path, path + ".birder", os.path.join(path + ".birder", MARKER)):
                try:
                    times.append(os.lstat(part).st_mtime_ns)
                except OSError:
                    pass
            step = checkpoint_step(birder_state_dir(path))
            marked = os.path.isfile(os.path.join(birder_state_dir(path), MARKER))
            # first those without a marker (incomplete: named in a warning), then by recorded step, then older
            # markers (no step recorded) by time
            found[path] = (2 if not marked else 1 if step is not None else 0, -1 if step is None else step, max(times))
    for path in sorted(found, key=found.get, reverse=True):
        problem = _lightning_checkpoint_problem(path)
        if problem is None:
            rank_zero_info(f"Resuming from {path}, the newest checkpoint complete on every rank.")
            return path
        rank_zero_warn(f"Not resuming from {path} ({problem}); it is left as it is.")
    rank_zero_info(f"No complete checkpoint in {folder}: starting fresh.")
    return None


def _check_trainer_settings(gradient_clip_val: float | None) -> None:
    if gradient_clip_val is not None and gradient_clip_val > 0:
        what = f"Trainer(gradient_clip_val={gradient_clip_val}) would clip Birder's direction (in [-1, 1]) in .grad"
        fix = "Remove gradient_clip_val (a step is bounded by lr already; Birder(grad_clip=...) clips the gradient)"
        raise ValueError(explain(what, fix))


def _check_precision(precision: str, opt) -> None:
    if not opt.loss_scaling and str(precision) == "16-mixed":
        raise ValueError(
            explain("OneBitAdam cannot train with precision='16-mixed'", "use precision='bf16-mixed' (or Birder)")
        )


def _one_bit_optimizer(optimizers: list, automatic_optimization: bool) -> Birder | OneBitAdam:
    if len(optimizers) != 1:
        mode = "automatic" if automatic_optimization else "manual"
        what = f"BirderDDPStrategy: configure_optimizers returned {len(optimizers)} ({mode} optimization)"
        fix = "put all parameters into one Birder or OneBitAdam (param groups may differ): DDP takes one hook"
        raise ValueError(explain(what, fix))
    opt = optimizers[0]
    if not isinstance(opt, OneBitOptimizer):
        what = f"configure_optimizers must return a birder_hf.Birder (or OneBitAdam), got {type(opt).__name__}"
        raise TypeError(explain(what, "return Birder(self.parameters(), lr=...), or use strategy='ddp'"))
    return opt


def _comm_metrics(state) -> dict[str, float]:
    if not state.steps_communicated:  # 1-bit Adam: its warm-up and compressed steps together
        return {}
    prefix, s = state.optimizer.metrics_prefix, state.stats
    extra = "skipped_steps" if isinstance(state, BirderHookState) else "compressed_steps"
    out = {
        prefix + "bytes_sent": s.total_bytes,
        prefix + "intra_node_bytes": s.intra_node_bytes,
        prefix + "inter_node_bytes": s.inter_node_bytes,
        prefix + "fp32_allreduce_bytes": s.fp32_allreduce_bytes,
        prefix + "compression_ratio": s.compression_ratio,
        prefix + extra: getattr(state, extra),
    }
    return {k: float(v) for k, v in out.items()}


class BirderDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that trains with Birder's 1-bit hook (see the module docstring).

    Args:
        method (`str`, *optional*, defaults to `"hierarchical"`): the 1-bit all-reduce: ``"hierarchical"``,
            ``"allgather"`` or ``"scatter_gather"`` (``birder_hf.onebit_all_reduce``). Ignored for OneBitAdam.
        inter_method (`str`, *optional*, defaults to `"allgather"`): the inter-node exchange of ``"hierarchical"``.
        chunk_numel (`int`, *optional*): bound on the elements per collective (receive buffers).
        hierarchy_num_nodes (`int`, *optional*): how many nodes Birder's hierarchy assumes; defaults to the
            Trainer's ``num_nodes``. Set it to simulate nodes on one machine (``devices=2`` and
            ``hierarchy_num_nodes=2`` make 2 nodes x 1 rank); it must divide the world size.
        log_comm_stats (`bool`, *optional*, defaults to `True`): log bytes sent and the compression ratio
            every step through ``LightningModule.log`` (subject to ``Trainer(log_every_n_steps=...)``).
        **kwargs: everything ``DDPStrategy`` takes (``find_unused_parameters``, ``static_graph``, ``timeout``,
            ``process_group_backend``, ...), except a second communication hook.

    Attributes:
        birder_hook_state: the ``BirderHookState`` (or ``OneBitAdamHookState``) of the current fit, ``None``
            in a single process; its ``stats`` hold the bytes sent. Kept after ``fit()`` returns.

    Example::

        >>> trainer = Trainer(accelerator="cpu", devices=2, strategy=BirderDDPStrategy(method="hierarchical"))
        >>> trainer.fit(model)   # model.configure_optimizers() returns Birder(self.parameters(), lr=1e-3)
    """

    strategy_name = "birder_ddp"

    def __init__(
        self,
        method: str = DEFAULT_METHOD,
        *,
        inter_method: str = DEFAULT_INTER_METHOD,
        chunk_numel: int | None = None,
        hierarchy_num_nodes: int | None = None,
        log_comm_stats: bool = True,
        **kwargs: Any,
    ):
        for name in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"):
            if kwargs.get(name) is not None:
                what = "BirderDDPStrategy registers Birder's hook itself, and DDP allows one"
                raise ValueError(explain(what, f"drop {name}=... (or use DDPStrategy for another hook)"))
        if kwargs.get("model_averaging_period") is not None:
            what = "model_averaging_period asks for post-local SGD, which averages parameters, not gradients"
            raise ValueError(explain(what, "drop it: it cannot be combined with Birder's 1-bit hook"))
        check_settings(method, inter_method, chunk_numel)
        if hierarchy_num_nodes is not None and int(hierarchy_num_nodes) < 1:
            raise ValueError(f"hierarchy_num_nodes={hierarchy_num_nodes} must be a positive number of nodes.")
        super().__init__(**kwargs)
        self.method, self.inter_method, self.chunk_numel = method, inter_method, chunk_numel
        self.hierarchy_num_nodes = hierarchy_num_nodes
        self.log_comm_stats = log_comm_stats
        self.birder_hook_state: HookState | None = None
        self._resume_checkpoint: str | None = None

    # ----------------------------------------------------------------------------------------- setup
    def setup(self, trainer) -> None:
        _check_trainer_settings(trainer.gradient_clip_val)
        self.birder_hook_state = None
        super().setup(trainer)  # wraps the model in DDP, then calls configure_optimizers
        if trainer.state.fn != TrainerFn.FITTING:
            return
        opt = _one_bit_optimizer(self.optimizers, self.lightning_module.automatic_optimization)
        _check_precision(trainer.precision, opt)
        if self.world_size == 1:
            rank_zero_info(f"{type(opt).__name__}: single process, no gradient communication to compress.")
            return
        self.birder_hook_state = self._register_hook(opt)

    def topology(self) -> Topology:
        """Birder's topology from Lightning's view: ``num_nodes`` x ``devices`` (collective: every rank calls it)."""
        if self.hierarchy_num_nodes is None:
            return Topology.from_layout(self.num_nodes, self.num_processes)
        k = int(self.hierarchy_num_nodes)
        if self.world_size % k:
            what = f"hierarchy_num_nodes={k} does not divide the world size {self.world_size}"
            raise ValueError(explain(what, "choose a divisor"))
        return Topology.from_layout(k, self.world_size // k)

    def _register_hook(self, opt: Birder | OneBitAdam):
        state = attach_ddp_hook(
            self.model,
            opt,
            topology=self.topology(),
            method=self.method,
            inter_method=self.inter_method,
            chunk_numel=self.chunk_numel,
            grad_scaler=getattr(self.precision_plugin, "scaler", None),  # "16-mixed" on GPUs: its scale is divided out
        )
        rank_zero_info(f"{type(opt).__name__}: {state.description} registered on {state.topology!r}")
        return state

    # ----------------------------------------------------------------------------------------- steps
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.log_comm_stats and self.birder_hook_state is not None:
            metrics = _comm_metrics(self.birder_hook_state)
            if metrics:
                self.lightning_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        return output

    # ------------------------------------------------------------------------------------ checkpoints
    def _one_bit_optimizer_or_none(self) -> Birder | OneBitAdam | None:
        opts = self.optimizers
        return opts[0] if len(opts) == 1 and isinstance(opts[0], OneBitOptimizer) else None

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        opt = self._one_bit_optimizer_or_none()
        if opt is None or "optimizer_states" not in checkpoint:  # save_weights_only: nothing to resume from
            return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        # the checkpoint folder is this job's (every rank together: another job writing it stops them all)
        claim_output_dir(
            os.path.dirname(os.path.abspath(filepath)), holder=self.is_global_zero, world_size=self.world_size
        )
        folder = birder_state_dir(filepath)
        clear_completion_marker(folder)  # every rank, before it writes (last.ckpt is rewritten at every save)
        failure = None
        try:
            save_rank_state(opt, folder, rank=self.global_rank, world_size=self.world_size)
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # rank 0 writes the .ckpt
        except Exception as exc:  # every rank still joins the marker's all-gather, which then fails everywhere
            failure = exc
        ckpt = os.path.realpath(filepath)
        write = self.is_global_zero and failure is None
        if write and not os.path.isfile(ckpt):
            write = False
            rank_zero_warn(
                f"{filepath} was not on disk after rank 0 saved it (an asynchronous CheckpointIO?): it is not marked "
                "complete, so nothing will resume from it."
            )
        mark_checkpoint_complete(
            folder,
            rank=self.global_rank,
            world_size=self.world_size,
            write=write,
            failed=failure,
            extra_files=[ckpt] if write else (),
            step=checkpoint.get("global_step"),
        )

    def remove_checkpoint(self, filepath) -> None:
        # a symlink (save_last="link") goes alone: its target keeps its Birder state
        folder = None if os.path.islink(filepath) else birder_state_dir(filepath)
        super().remove_checkpoint(filepath)
        if folder is not None:
            # every rank removes it (each node its own copy on a non-shared disk); racing removals are harmless
            shutil.rmtree(folder, ignore_errors=True)

    def load_checkpoint(self, checkpoint_path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._resume_checkpoint = os.fspath(checkpoint_path)
        if self._fitting():
            self._check_complete(self._resume_checkpoint)
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    def _fitting(self) -> bool:
        if self.lightning_module is None:
            return False
        try:
            trainer = self.lightning_module.trainer
        except RuntimeError:  # a module not attached to a Trainer
            return False
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING

    def _check_complete(self, path: str) -> None:
        # before anything loads, on every rank together: the same checkpoint, complete (a .ckpt without a Birder
        # folder is left to load_optimizer_state_dict's error, after Lightning has looked at what it holds)
        problem = None
        if os.path.isdir(birder_state_dir(path)):
            problem = _lightning_checkpoint_problem(path)
        reports = gather((path, problem), world_group(self.world_size))
        paths = {p for p, _ in reports}
        if len(paths) > 1:
            what = f"The ranks would resume from different checkpoints ({', '.join(sorted(paths))})"
            raise RuntimeError(explain(what, "pass every rank the same ckpt_path (on a disk that every rank sees)"))
        bad = next(((r, p) for r, (_, p) in enumerate(reports) if p is not None), None)
        if bad is not None:
            rank, problem = bad
            what = f"{path} is not complete on every rank (rank {rank} sees: {problem}); nothing was loaded"
            fix = "pass ckpt_path=find_resumable_lightning_checkpoint(dirpath) to trainer.fit"
            raise RuntimeError(explain(what, fix))

    def load_optimizer_state_dict(self, checkpoint) -> None:
        super().load_optimizer_state_dict(checkpoint)  # rank 0's state, on every rank
        opt, path = self._one_bit_optimizer_or_none(), self._resume_checkpoint
        if opt is None or path is None:
            return
        folder = birder_state_dir(path)
        try:
            state = read_own_rank_state(opt, folder, rank=self.global_rank, world_size=self.world_size)
        except FileNotFoundError as exc:
            what = f"{path} has no per-rank Birder state ({folder}/): not written by BirderDDPStrategy or not copied"
            fix = f"resume from a checkpoint BirderDDPStrategy saved ({exc})"
            raise FileNotFoundError(explain(what, fix)) from exc
        opt.load_own_state_dict(state)

    def teardown(self) -> None:
        self._resume_checkpoint = None
        if self.birder_hook_state is not None:
            self.birder_hook_state.close()  # its process groups and their threads, now (statistics stay readable)
        super().teardown()
