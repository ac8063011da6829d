"""A ``transformers.Trainer`` that shards its own model with FSDP2 on a ``(replicate, shard)`` mesh.

``ShardedTrainerMixin`` is what ``BirderTrainer``'s ``sharding="hsdp"`` (1-bit HSDP, ``birder_hf.fsdp``) and
``HSDPTrainer`` (native HSDP: full precision across nodes, the uncompressed baseline) share; nothing in it is specific
to Birder. The Trainer has no public seam for a model it must not wrap, so it overrides these protected methods:
``_defer_fsdp_gradient_reduction`` (gradient accumulation through FSDP's ``set_requires_gradient_sync``),
``_load_from_checkpoint`` (full weights back into the shards) and it sets the Trainer's
``is_distributed_loading_by_transformers`` flag (no DDP wrapping, no second sharding); ``save_model`` is public.
"""

from __future__ import annotations

import contextlib
import logging
import os

from ..base import explain
from ..fsdp import hsdp_mesh, shard_model
from . import needs_extra

with needs_extra(__name__, "transformers", "transformers"):
    from transformers import Trainer

__all__ = ["ShardedTrainerMixin", "HSDPTrainer"]

logger = logging.getLogger(__name__)


class ShardedTrainerMixin:
    """A ``Trainer`` that shards its model with FSDP2 itself, on a ``(replicate, shard)`` mesh (module docstring).

    After ``Trainer.__init__``, :meth:`shard_for_training` applies ``fully_shard`` to every block and the root, and
    puts the Trainer in its mode for a model that arrives FSDP2-sharded and reduces its own gradients (the mode of
    ``from_pretrained(distributed_config=...)``): no DDP wrapping, gradient accumulation through FSDP's
    ``set_requires_gradient_sync``. Checkpoints hold the full weights (``save_pretrained``; every rank takes part in
    the gather) and load back into the shards.
    """

    birder_mesh = None  # the (replicate, shard) DeviceMesh, once sharded

    def shard_for_training(self, num_nodes: int | None, *, across_nodes: bool) -> None:
        """Shard ``self.model`` on the ``"shard"`` dimension (``across_nodes=False``: Birder's 1-bit HSDP) or on the
        whole 2-D mesh (``True``: native HSDP, full-precision all-reduce across nodes)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("sharding='hsdp' needs a distributed launch (torchrun or accelerate launch).")
        if self.optimizer is not None:
            what = "sharding='hsdp' creates the optimizer after sharding the model"
            raise ValueError(explain(what, "pass optimizer_cls_and_kwargs= instead of an optimizer (optimizers=)"))
        if self.args.fsdp or self.args.deepspeed:
            raise ValueError(explain("sharding='hsdp' shards the model itself", "drop --fsdp/--deepspeed"))
        mesh = hsdp_mesh(num_nodes if num_nodes is not None else _launcher_nodes(), self.args.device.type)
        shard_model(self.model, mesh if across_nodes else mesh["shard"])
        self.birder_mesh = mesh
        # the Trainer's own flag for a model sharded before it: it neither wraps it in DDP nor shards it again
        self.is_distributed_loading_by_transformers = True
        logger.info("Model sharded with FSDP2 on %r (%s).", mesh, "native HSDP" if across_nodes else "1-bit HSDP")

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        # micro-batches before the last: FSDP keeps the unsharded gradient and reduce-scatters once
        if self.birder_mesh is None:
            with super()._defer_fsdp_gradient_reduction():
                yield
            return
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.birder_mesh is None:
            return super().save_model(output_dir, _internal_call)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # every rank takes part in gathering the full weights; the main process writes them
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.args.should_save:
            self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=full)
        if self.args.push_to_hub and not _internal_call:  # as Trainer.save_model does
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self.birder_mesh is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state = _model_keys(self.model, _read_full_weights(resume_from_checkpoint), resume_from_checkpoint)
        # every key is there (checked above) but tied weights (an LM head sharing the embedding), saved once
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=False))


class HSDPTrainer(ShardedTrainerMixin, Trainer):
    """``transformers.Trainer`` with native HSDP (FSDP2 on the 2-D mesh: full precision across nodes), for any
    optimizer: the uncompressed baseline of Birder's 1-bit HSDP. ``num_nodes``: default from the launcher."""

    def __init__(self, *args, num_nodes: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.shard_for_training(num_nodes, across_nodes=True)


def _launcher_nodes() -> int:
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    world = dist.get_world_size()
    if local < 1 or world % local:
        what = f"LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')!r} gives no node layout of {world} ranks"
        raise ValueError(explain(what, "pass --num_nodes"))
    return world // local


def _model_keys(model, saved: dict, folder: str) -> dict:
    """``saved`` (what ``save_pretrained`` wrote) under ``model``'s own keys, checked: every weight of the model is
    there but tied ones (saved once), and nothing else. Raises ``ValueError`` naming the keys, before anything is
    loaded.

    transformers saves some models under their checkpoints' original names (a ``ViTForImageClassification``'s
    ``...attention.attention.key...`` for its ``...attention.k_proj...``); ``from_pretrained`` renames them back, a
    plain load would skip them. The renaming is read from transformers' own (``revert_weight_conversion``, run on
    placeholder tensors of the model's keys).
    """
    import torch

    own = model.state_dict()  # keys and (full) shapes only: no gather
    rename = {}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # an older transformers saves under the model's own keys
        revert_weight_conversion = None
    if revert_weight_conversion is not None and hasattr(model, "config") and set(saved) - set(own):
        probe = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in own.items()}
        ids = {id(t): k for k, t in probe.items()}
        try:
            reverted = revert_weight_conversion(model, dict(probe))
        except Exception:  # noqa: BLE001  (a conversion that needs real tensors: the key check below reports it)
            reverted = {}
        rename = {saved_key: ids[id(t)] for saved_key, t in reverted.items() if id(t) in ids}
    state = {rename.get(k, k): v for k, v in saved.items()}
    # tied weights: one tensor under several keys; the checkpoint needs one of them
    tied: dict[int, set] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        tied.setdefault(id(t), set()).add(name)
    twins = {name: names for names in tied.values() for name in names}
    missing = [k for k in own if k not in state and not (twins.get(k, set()) & state.keys())]
    unexpected = [k for k in saved if rename.get(k, k) not in own]
    if missing or unexpected:
        show = lambda keys: f"{keys[:6]}{f' and {len(keys) - 6} more' if len(keys) > 6 else ''}"  # noqa: E731
        parts = [f"{len(missing)} of its {len(own)} keys are not there: {show(missing)}"] if missing else []
        parts += [f"{len(unexpected)} saved keys are not the model's: {show(unexpected)}"] if unexpected else []
        what = f"The weights in {folder} do not match the model ({type(model).__name__}): {'; '.join(parts)}"
        fix = "resume with the model (class and config) that wrote the checkpoint"
        raise ValueError(explain(f"{what}. Nothing was loaded", fix))
    return state


def _read_full_weights(folder: str) -> dict:
    """The weights ``save_pretrained`` wrote in ``folder`` (one safetensors file or an index of shards)."""
    import json

    from safetensors.torch import load_file

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state = {}
    for name in files:
        state.update(load_file(os.path.join(folder, name)))
    return state
