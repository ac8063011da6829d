"""1-bit HSDP: FSDP2 inside each node, Birder's 1-bit all-reduce across the nodes.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB
Official code: https://openi.pcl.ac.cn/c2net_optim/Birder

Our extension of the paper (which trains every worker with the whole model; ``docs/ALGORITHM.md`` has the math):
the model is sharded with FSDP2 (``fully_shard``) on the ``"shard"`` dimension of a 2-D ``(replicate, shard)``
DeviceMesh, one row of the mesh per node. FSDP's reduce-scatter averages the gradient inside the node in full
precision; the *node* is Birder's worker. Each rank keeps ``m``, ``b`` for its shard only (EMAs of its node's
averaged gradient: 8 bytes per parameter divided by the ranks per node) and Birder's 1-bit all-reduce of ``u`` runs
over the replicate group (the ranks holding the same shard on every node): 1 bit per element of the shard crosses
the nodes per step, and nothing else does.

Two communicators (``docs/ARCHITECTURE.md``): :class:`FSDPHookState` (``in_backward=True``, the default: FSDP's
all-reduce hook hands it each unit's reduce-scatter output during backward) and
:class:`birder_hf.communicators.StepAllReduce` (``in_backward=False``: the same exchange inside ``step()``). The hook
leaves ``.grad`` as FSDP put it (the node's averaged gradient of this shard) and keeps ``d`` itself: FSDP divides and
casts the reduce output after the hook returns, before the asynchronous result is there. Both key each element's
random bits by its index in the full flattened parameter, so the bits depend on the shard layout only through which
node draws them.

What runs and what is refused at set-up (with the fix): ``docs/SETUPS.md`` (sharded rows and 1-bit HSDP).

Usage::

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = Birder(model.parameters(), lr=1e-3)
    state = register_birder_fsdp(model, opt, mesh)        # Birder: 1 bit across the nodes
    ...
    save_rank_state(opt, ckpt_dir)                        # m, b differ between nodes: one file per rank
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

from .base import explain, is_sharded, local_tensor, shard_offset, unwrap_optimizer
from .communicators import StepAllReduce, UsageMarks
from .hook import BirderStagedState, encode_and_stage, start_exchange, u_buffer
from .optim import Birder
from .settings import DEFAULT_INTER_METHOD, DEFAULT_METHOD, CommSettings, check_settings
from .topology import Topology

__all__ = ["register_birder_fsdp", "FSDPHookState", "fsdp_units", "hsdp_mesh", "shard_model"]


def hsdp_mesh(num_nodes: int, device_type: str = "cuda"):
    """The 2-D ``(replicate, shard)`` DeviceMesh of ``num_nodes`` nodes over every rank (node-major ranks, as
    torchrun numbers them). Collective."""
    world = dist.get_world_size()
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1 or world % num_nodes:
        raise ValueError(f"num_nodes={num_nodes!r} must be an int >= 1 that divides the world size {world}.")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (num_nodes, world // num_nodes), mesh_dim_names=("replicate", "shard"))


def shard_model(model: torch.nn.Module, mesh, *, block_classes=None, **fully_shard_kwargs) -> torch.nn.Module:
    """Apply ``fully_shard`` on ``mesh`` to every block of ``model``, then to ``model`` itself (in place).

    Blocks are the modules whose class name is in ``block_classes`` (default: a Hugging Face model's
    ``_no_split_modules``, its transformer layers). For Birder pass ``mesh["shard"]`` (FSDP inside the node); the 2-D
    mesh itself gives native HSDP (full-precision all-reduce across the nodes: the uncompressed baseline).
    ``fully_shard_kwargs`` (``mp_policy``, ``reshard_after_forward``, ...) go to every call. Returns ``model``.
    """
    from torch.distributed.fsdp import fully_shard

    names = set(block_classes if block_classes is not None else getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            explain(f"shard_model: {type(model).__name__} has no _no_split_modules", "pass block_classes=[...]")
        )
    blocks = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not blocks:
        raise ValueError(f"shard_model: {type(model).__name__} has no module of the classes {sorted(names)}.")
    for block in blocks:
        fully_shard(block, mesh=mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=mesh, **fully_shard_kwargs)
    return model


class FSDPUnit(NamedTuple):
    """One FSDP unit (a module ``fully_shard`` was applied to) as its reduce-scatter output lays it out."""

    module: torch.nn.Module
    params: list  # FSDP's own list of its FSDPParams, in reduce-scatter order (read at every hook call)

    def layout(self) -> list[tuple[torch.Tensor, int]]:
        """``(sharded parameter, elements it takes in the reduce output)`` for every parameter that requires grad.

        FSDP pads dim 0 of each parameter to a multiple of the shard-group size ``n`` before its reduce-scatter, so
        each takes ``ceil(rows / n) * (numel / rows)`` elements of the output, its local shard first.
        """
        out = []
        for fp in self.params:
            p = fp.sharded_param
            if not p.requires_grad:
                continue
            rows = p.shape[0] if p.dim() else 1
            n = p.device_mesh.size(0)
            out.append((p, -(-rows // n) * (p.numel() // rows if rows else 0)))
        return out


def fsdp_units(model: torch.nn.Module) -> list[FSDPUnit]:
    """The FSDP2 units of ``model`` that hold parameters, with FSDP's parameter order (read from torch's FSDP state:
    the reduce-scatter output of a unit concatenates its parameters in that order, which no public API exposes)."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        try:
            groups = list(module._get_fsdp_state()._fsdp_param_groups)
            for fp in (fp for g in groups for fp in g.fsdp_params):
                fp.sharded_param  # noqa: B018  (fail here, not in the first backward, if torch moved it)
        except AttributeError as exc:  # pragma: no cover - a torch whose FSDP2 internals moved
            raise RuntimeError(
                explain(f"birder_hf.fsdp cannot read this torch's FSDP2 internals ({exc})", "pass in_backward=False")
            ) from exc
        if len(groups) > 1:
            raise ValueError(
                explain(f"{type(module).__name__} has {len(groups)} FSDP parameter groups", "drop shard_placement_fn")
            )
        if groups and groups[0].fsdp_params:
            units.append(FSDPUnit(module, groups[0].fsdp_params))
    return units


class FSDPHookState(BirderStagedState):
    """State of Birder's FSDP2 all-reduce hook: the 1-bit exchange of each FSDP unit's shard across the nodes.

    Built by :func:`register_birder_fsdp`. The statistics (``stats``, ``last_step_stats``, ``steps_communicated``,
    ``skipped_steps``) are those of every hook state; all bytes count as inter-node. Birder's side (the staged ``m``,
    ``b``, the encode-and-stage, the exchange, the commit) is the DDP hook's: :class:`birder_hf.hook.BirderStagedState`
    and its functions.

    Args:
        optimizer (`Birder`): the optimizer of the sharded parameters.
        topology (`Topology`): this rank's replicas, ``Topology.from_replicate_dim(mesh)``.
        comm_settings (`CommSettings`): the 1-bit all-reduce's settings, as :func:`register_birder_fsdp` built them.
        check_finite, grad_scaler: as for :class:`birder_hf.BirderHookState`.
        agree_group (`ProcessGroup`): every rank of the mesh (skipped steps are agreed by all shards).
    """

    hook_name = "birder_fsdp_hook"
    wrapped_name = "the FSDP model"
    # skip_unused (BirderStagedState's): FSDP hands the hook zeros for a parameter no rank of the node used
    # (set_reduce_scatter_unused_params): the ranks agree which parameters any rank used (marked on FSDP's unsharded
    # parameters, watch_units) and step those

    __slots__ = ()

    def __init__(self, optimizer: Birder, topology: Topology, comm_settings: CommSettings, **kwargs):
        super().__init__(optimizer, topology, comm_settings=comm_settings, **kwargs)

    @property
    def description(self) -> str:
        k = self.topology.num_nodes
        return f"1-bit {self.comm_settings.method} FSDP hook across {k} node{'s' if k != 1 else ''}"

    def watch_units(self, units: list[FSDPUnit]) -> None:
        """Mark a parameter used when autograd accumulates a gradient into its unsharded parameter (see
        :class:`birder_hf.communicators.UsageMarks`)."""
        _watch_units(units, self.marks)

    def reduce(self, index: int, unit: FSDPUnit, reduce_output: torch.Tensor) -> None:
        """The hook body for unit ``index``: encode its shard of the node-averaged gradient, start the all-reduce."""
        self.begin_backward()
        layout = unit.layout()
        expected = sum(n for _, n in layout)
        if reduce_output.numel() != expected:
            name, numel = type(unit.module).__name__, reduce_output.numel()
            what = f"birder_fsdp_hook: {name}'s reduce-scatter output has {numel} elements, its parameters {expected}"
            fix = "keep requires_grad as at register_birder_fsdp and set_reduce_scatter_unused_params(True)"
            raise RuntimeError(explain(what, fix))
        items, offset = [], 0
        for p, taken in layout:
            group = self.group_to_stage(
                p,
                "An FSDP parameter",
                "build the optimizer from the sharded model's parameters, after fully_shard",
                "accumulate with model.set_requires_gradient_sync(False) on all but the last micro-batch",
            )
            x = local_tensor(p)
            items.append((p, reduce_output[offset : offset + x.numel()].view(x.shape), group))
            offset += taken
        work = torch.float64 if reduce_output.dtype == torch.float64 else torch.float32
        numel = sum(g.numel() for _, g, _ in items)
        u = u_buffer(self, index, numel, work, reduce_output.device, keep=True)
        _, keys = encode_and_stage(self, items, u, keep=True)
        if self.check_finite:
            self.flag_nonfinite(u)  # u = m / b is NaN exactly where the gradient was not finite
        self.in_flight.append(start_exchange(self, u, keys))


def _watch_units(units: list[FSDPUnit], marks: UsageMarks) -> None:
    # FSDP creates a unit's unsharded parameters at its first all-gather (in its forward pre-hook, registered first):
    # from this forward pre-hook on, autograd's accumulation into one marks the sharded parameter used this step
    def watcher(unit: FSDPUnit):
        @torch.compiler.disable  # registers hooks (a side effect), once per parameter: never traced
        def pre_forward(module, args):
            for fp in unit.params:
                p = fp.sharded_param
                if p not in marks.watched and hasattr(fp, "_unsharded_param"):
                    marks.watch(p, fp.unsharded_param)

        return pre_forward

    for unit in units:
        marks.handles.append(unit.module.register_forward_pre_hook(watcher(unit)))


def _refuse_wrappers(model) -> torch.nn.Module:
    """``model`` with ``torch.compile``'s wrapper removed; refuses DDP, FSDP1 and DeepSpeed with the fix."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    inner = getattr(model, "_orig_mod", model)
    name = type(inner).__name__
    if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
        fix = "use birder_hf.hook.attach_ddp_hook(model, optimizer) (accelerate: register_birder_hook)"
        raise TypeError(explain("register_birder_fsdp got a DistributedDataParallel model", fix))
    if isinstance(inner, FullyShardedDataParallel) or any(
        isinstance(m, FullyShardedDataParallel) for m in inner.modules()
    ):
        what = "register_birder_fsdp supports FSDP2 (fully_shard), not FSDP1 (FullyShardedDataParallel)"
        fix = "wrap with fully_shard(module, mesh=mesh['shard']) (accelerate: fsdp_version: 2)"
        raise TypeError(explain(what, fix))
    if "DeepSpeed" in name:
        what = "Birder does not run under DeepSpeed (ZeRO reduces gradients itself)"
        raise TypeError(explain(what, "use FSDP2 or DDP"))
    return inner


def _shard_grid(mesh) -> list[list[int]]:
    """``grid[node][local]`` of a 2-D (replicate, shard) mesh, or the one row of a 1-D mesh (FSDP over all ranks)."""
    ndim = getattr(mesh, "ndim", None)
    if ndim not in (1, 2) or not hasattr(mesh, "mesh"):
        what = (
            f"register_birder_fsdp needs a 2-D (replicate, shard) DeviceMesh, got {type(mesh).__name__}"
            f"{'' if ndim is None else f' of {ndim} dimensions'}"
        )
        raise ValueError(explain(what, "build it with birder_hf.fsdp.hsdp_mesh(num_nodes)"))
    grid = mesh.mesh.tolist()
    return grid if ndim == 2 else [grid]


def _check_model(model, optimizer: Birder, grid: list[list[int]]) -> None:
    """Every trainable parameter: a Shard(0) DTensor of FSDP on this rank's node row, owned by the optimizer."""
    rank = dist.get_rank()
    row = next((r for r in grid if rank in r), None)
    if row is None or sum(len(r) for r in grid) != dist.get_world_size():
        what = f"The mesh {grid} must cover every rank once (world size {dist.get_world_size()})"
        raise ValueError(explain(what, "build it with hsdp_mesh(num_nodes)"))
    for name, p in model.named_parameters():
        problem = _parameter_problem(p, row, optimizer) if p.requires_grad else None
        if problem is not None:
            raise ValueError(explain(f"parameter {name!r} (shape {tuple(p.shape)}) {problem[0]}", problem[1]))


def _parameter_problem(p: torch.Tensor, row: list[int], optimizer: Birder) -> tuple[str, str] | None:
    """What is wrong with a trainable parameter for 1-bit HSDP, and the fix; ``None``: nothing."""
    if not is_sharded(p):
        return "is not sharded by FSDP2: its gradient would stay rank-local", "shard the root too"
    mesh = p.device_mesh
    if mesh.ndim != 1:
        what = f"is on a {mesh.ndim}-D mesh ({p.placements}): native 2-D HSDP reduces in full precision"
        return what, "shard on the node: shard_model(model, mesh['shard']) (Trainer: BirderArguments(sharding='hsdp'))"
    ranks = mesh.mesh.tolist()
    if ranks != row:
        what = f"is sharded over ranks {ranks}, but this rank's node in the mesh holds {row}"
        return what, "shard with fully_shard(module, mesh=mesh['shard']) on this mesh"
    if p.device.type != mesh.device_type:
        return f"is on {p.device} but the mesh on {mesh.device_type}", "drop offload_policy"
    shard_offset(p)  # raises for placements other than Shard(0)
    if optimizer.group_of(p) is None:
        what = "requires grad but is not in the Birder optimizer"
        return what, "build the optimizer from the sharded model's parameters, after fully_shard"
    return None


def register_birder_fsdp(
    model: torch.nn.Module,
    optimizer,
    mesh,
    *,
    method: str = DEFAULT_METHOD,
    inter_method: str = DEFAULT_INTER_METHOD,
    chunk_numel: int | None = None,
    check_finite: bool = True,
    in_backward: bool = True,
    grad_scaler=None,
):
    """Train an FSDP2-sharded ``model`` with Birder: full precision inside a node, 1 bit across the nodes.

    Args:
        model (`torch.nn.Module`): wrapped with ``fully_shard(..., mesh=mesh["shard"])`` (per block, and on the root);
            ``torch.compile``-d or not.
        optimizer (`Birder`, or a framework's wrapper of it): built from ``model``'s (sharded) parameters.
        mesh (`DeviceMesh`): the 2-D ``(replicate, shard)`` mesh (dimension 0: the nodes; dimension 1: the ranks of a
            node), or a 1-D mesh of all ranks (FSDP without a replicate dimension: nothing to compress, see the
            module docstring).
        method (`str`, *optional*, defaults to `"hierarchical"`): the 1-bit all-reduce across the nodes (one rank
            each): ``"hierarchical"`` and ``"allgather"`` give the exact mean of the nodes' votes, ``"scatter_gather"``
            a re-quantized ±1.
        inter_method, chunk_numel, check_finite: as for :class:`birder_hf.BirderHookState`.
        in_backward (`bool`, *optional*, defaults to `True`): run the exchange in FSDP's all-reduce hook during
            backward (overlapping it); ``False`` runs it in ``optimizer.step()`` (same result, no overlap).
        grad_scaler (`torch.amp.GradScaler`, *optional*): fp16 loss scaling with ``in_backward=True``: the scaler that
            scales the loss, whose scale the hook divides out (as :class:`birder_hf.BirderHookState`); the step()
            path gets the scale from the scaler's ``step()`` and needs nothing.

    A parameter no rank used in a step (a branch not taken) is not stepped on either path, and its ``m`` and ``b``
    stay as they were, as under DDP, also with ``set_reduce_scatter_unused_params(True)`` (FSDP then hands over zeros
    for it; ``in_backward=True`` sets it, so that ranks that used different parameters reduce the same layout).

    Returns:
        The communicator: :class:`FSDPHookState` (``in_backward=True``) or
        :class:`birder_hf.communicators.StepAllReduce`; both have ``stats`` (bytes sent, all inter-node).

    Collective: every rank calls it, in the same order as its other process-group creations.
    """
    comm = check_settings(method, inter_method, chunk_numel)
    opt = unwrap_optimizer(optimizer)
    if getattr(opt, "sharding_refusal", None):
        raise TypeError(opt.sharding_refusal)
    if not isinstance(opt, Birder):
        raise TypeError(f"register_birder_fsdp needs a birder_hf.Birder optimizer, got {type(opt).__name__}.")
    if opt.communicator is not None:
        what = f"This Birder optimizer already has a communicator ({type(opt.communicator).__name__})"
        fix = "call register_birder_fsdp once, and pass no process_group=/topology= to Birder"
        raise ValueError(explain(what, fix))
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("register_birder_fsdp needs torch.distributed to be initialized (init_process_group).")
    from torch.distributed import fsdp as torch_fsdp

    if in_backward and not hasattr(getattr(torch_fsdp, "FSDPModule", None), "set_all_reduce_hook"):
        what = f"torch {torch.__version__} has no FSDPModule.set_all_reduce_hook (torch >= 2.7 has)"
        raise RuntimeError(explain(what, "upgrade torch, or pass in_backward=False"))
    inner = _refuse_wrappers(model)
    grid = _shard_grid(mesh)
    _check_model(inner, opt, grid)
    if in_backward:
        units = fsdp_units(inner)
    else:
        try:
            units = fsdp_units(inner)
        except RuntimeError:  # a torch whose FSDP2 internals moved: unused parameters are those whose .grad is None
            units = None
    if in_backward and not units:
        fix = "shard it first: shard_model(model, mesh['shard'])"
        raise ValueError(explain("register_birder_fsdp found no FSDP2 module with parameters in the model", fix))
    if len(grid) == 1:
        what = "register_birder_fsdp: the mesh has no replicate dimension, so nothing is left to send in 1 bit"
        fix = "Birder trains as one worker. For 1 bit across nodes, shard on mesh['shard'] of a 2-D mesh"
        warnings.warn(explain(what, fix), UserWarning, stacklevel=2)
    # Every rank builds the same groups in the same order: the replicas of each shard, then all ranks (agreement).
    topology = Topology.from_replicate_dim(mesh)
    everyone = dist.new_group(list(range(dist.get_world_size())))
    if not in_backward:
        StepAllReduce.agree_on_setup(  # the settings every rank's communicator shares, as the hook states agree on
            opt,
            comm,
            topology=topology,
            agree_group=everyone,
            what="register_birder_fsdp",
        )
        usage = None
        if units is not None:
            usage = UsageMarks()
            _watch_units(units, usage)
        communicator = StepAllReduce(comm, topology=topology, agree_group=everyone, usage=usage)
        communicator.attach(opt)
        return communicator
    state = FSDPHookState(
        opt, topology, comm, check_finite=check_finite, agree_group=everyone, grad_scaler=grad_scaler
    )
    try:
        if check_finite:
            state.watch_units(units)
        for index, unit in enumerate(units):
            # include the zero gradients of unused parameters, so every unit's output has its full layout (older
            # torch has no such switch: a unit with an unused parameter then fails with a clear error in backward)
            if hasattr(unit.module, "set_reduce_scatter_unused_params"):
                unit.module.set_reduce_scatter_unused_params(True, recurse=False)
            unit.module.set_all_reduce_hook(functools.partial(state.reduce, index, unit))  # hook(reduce_output)
    except BaseException:
        state.detach()
        raise
    return state
