"""Topology: the intra-node and inter-node process groups of the Hierarchical-1-bit-All-Reduce.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB
Official code: https://openi.pcl.ac.cn/c2net_optim/Birder
Deviations from the paper: none known; the paper's code was not available to us, so how nodes are
discovered (the launcher's ``LOCAL_WORLD_SIZE`` / ``GROUP_RANK``, a 2-D ``DeviceMesh`` or an explicit
layout) is our reconstruction.

A topology is ``num_nodes`` nodes of ``local_world_size`` ranks each. Subgroups are built once, by every
rank in the same order (as ``HierarchicalModelAverager`` does), and the object is passed explicitly to
:func:`birder_hf.collectives.onebit_all_reduce`; it is never created lazily inside a hook.

The groups are the topology's own (``dedicated=True``), never the default group or a mesh's groups:
an async 1-bit all-reduce runs its later stages from the backend's callback threads, and DDP itself
all-reduces on the default group at the same time (``find_unused_parameters=True``); on a shared group
the two streams of collectives could be issued in different orders on different ranks and mix up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch.distributed as dist

from .base import explain
from .lifecycle import track_groups, untrack_groups, wait_for_callbacks
from .together import gather

__all__ = ["Topology"]


def _require_initialized(where: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        fix = "call torch.distributed.init_process_group(...) first (Accelerator() and the Trainer do)"
        raise RuntimeError(explain(f"{where} needs an initialized default process group", fix))


def _build_group(enumeration: list[list[int]], world_group):
    # Every rank takes part in creating every subgroup, in the same order. A group of one rank needs
    # no collective, so none is created (None stands for "just this rank"); a group of all ranks is
    # the topology's own world group.
    if len(enumeration[0]) == 1:
        return None
    if len(enumeration) == 1:
        return world_group
    mine, _ = dist.new_subgroups_by_enumeration(enumeration)
    return mine


def _layout_problem(where: str, num_nodes, local_world_size, world: int) -> str | None:
    for name, value in (("num_nodes", num_nodes), ("local_world_size", local_world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{where}: {name} must be an int >= 1, got {value!r}."
    if num_nodes * local_world_size != world:
        return (
            f"{where}: num_nodes x local_world_size must equal the world size {world}; choose a "
            f"local_world_size that divides {world}."
        )
    return None


_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK")


@dataclass(frozen=True, eq=False)
class Topology:
    """Where each rank sits: ``num_nodes`` nodes x ``local_world_size`` ranks.

    Attributes:
        rank, world_size: this rank and the size of ``world_group``.
        local_rank, local_world_size (``L``): position inside the node and ranks per node.
        node_rank, num_nodes (``k``): the node's index and the number of nodes.
        world_group: the process group spanning all ranks (the flat methods use it).
        intra_group: the ranks of this node, ordered by ``local_rank``; ``None`` when ``L == 1``.
        inter_group: the ranks with this ``local_rank`` on every node, ordered by ``node_rank``;
            ``None`` when ``k == 1``. (``None`` means "only this rank, no collective needed"; do not
            pass it to ``torch.distributed``, where ``None`` means the default group.)
        intra_ranks, inter_ranks: the global ranks of those groups.
        owned_groups: the groups the topology built itself (``close()`` destroys them).
        closed: whether :meth:`close` released the groups.

    A topology holds process groups: it cannot be pickled and has no state to checkpoint; rebuild it
    after a restart. It is immutable, and compares by identity. :meth:`close` releases the groups it built (every
    rank, after its last use; the hook states' ``close()`` calls it).

    Example::

        >>> topo = Topology.from_env()          # under torchrun / accelerate launch
        >>> topo
        Topology(2 nodes x 8 ranks, rank 3)
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    world_group: object
    intra_group: object
    inter_group: object
    intra_ranks: tuple[int, ...]
    inter_ranks: tuple[int, ...]
    owned_groups: tuple = field(default=(), repr=False)  # the groups this topology built (close() destroys them)
    closed: bool = field(default=False, init=False, repr=False)

    def __post_init__(self):
        for name, low in (("world_size", 1), ("local_world_size", 1), ("num_nodes", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"Topology: {name} must be an int >= {low}, got {value!r}.")
        for name, size in (("rank", "world_size"), ("local_rank", "local_world_size"), ("node_rank", "num_nodes")):
            value, bound = getattr(self, name), getattr(self, size)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < bound:
                what = f"Topology: {name}={value!r} is not in [0, {size}={bound})"
                raise ValueError(explain(what, "build it with Topology.from_env(), flat() or from_layout()"))
        if self.local_world_size * self.num_nodes != self.world_size:
            raise ValueError(f"{self.num_nodes} nodes x {self.local_world_size} ranks != world size {self.world_size}")
        object.__setattr__(self, "intra_ranks", tuple(self.intra_ranks))
        object.__setattr__(self, "inter_ranks", tuple(self.inter_ranks))
        if self.owned_groups:
            track_groups(self)  # closed at exit, after the callbacks on its groups are released

    # ----------------------------------------------------------------------------------- constructors
    @classmethod
    def flat(cls, group=None, *, dedicated: bool = True) -> Topology:
        """One node holding every rank of ``group`` (default: the default process group).

        Args:
            group (`ProcessGroup`, *optional*): the ranks taking part; defaults to the default group.
            dedicated (`bool`, *optional*, defaults to `True`): build a private copy of ``group`` (every
                member must call this, in the same order as other group creations). ``False`` uses
                ``group`` itself: no collective to build it, but async calls may then interleave with
                other collectives on ``group`` (see the module docstring).
        """
        _require_initialized("Topology.flat")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            what = f"Topology.flat(group): group is a {type(group).__name__}"
            raise TypeError(explain(what, "pass a torch.distributed ProcessGroup or None (the default group)"))
        group = dist.group.WORLD if group is None else group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("Topology.flat(group): this process is not a member of `group`")
        ranks = tuple(dist.get_process_group_ranks(group))
        owned = ()
        if dedicated and size > 1:
            # members only need to call when group is a proper subgroup
            local = size != dist.get_world_size()
            group = dist.new_group(list(ranks), use_local_synchronization=local)
            rank, ranks = dist.get_rank(group), tuple(dist.get_process_group_ranks(group))
            owned = (group,)
        return cls(
            rank=rank,
            world_size=size,
            local_rank=rank,
            local_world_size=size,
            node_rank=0,
            num_nodes=1,
            world_group=group,
            intra_group=group if size > 1 else None,
            inter_group=None,
            intra_ranks=ranks,
            inter_ranks=(ranks[rank],),
            owned_groups=owned,
        )

    @classmethod
    def from_layout(cls, num_nodes: int, local_world_size: int) -> Topology:
        """``num_nodes`` x ``local_world_size`` over the default group, node-major: node ``g`` holds
        ranks ``g*L .. g*L+L-1``. Handy to simulate several nodes on one host (``from_layout(2, 2)``).

        Collective: every rank must call it, with the same arguments; every rank checks that they do (one
        small all-gather) and all raise the same ``ValueError`` otherwise.
        """
        where = f"Topology.from_layout({num_nodes!r}, {local_world_size!r})"
        _require_initialized("Topology.from_layout")
        world = dist.get_world_size()
        problem = _layout_problem(where, num_nodes, local_world_size, world)
        if world > 1:
            # gather first, then every rank judges the same table: all raise together, none waits for the others
            table = gather((repr(num_nodes), repr(local_world_size), problem), dist.group.WORLD)
            problems = [(r, row[2]) for r, row in enumerate(table) if row[2]]
            if problems:
                r, problem = problems[0]
                raise ValueError(problem if len({row[:2] for row in table}) == 1 else f"rank {r}: {problem}")
            if len({row[:2] for row in table}) > 1:
                layouts = ", ".join(f"rank {r} ({row[0]}, {row[1]})" for r, row in enumerate(table))
                what = "Topology.from_layout: the ranks asked for different layouts (num_nodes, local_world_size)"
                raise ValueError(explain(f"{what}: {layouts}", "every rank must pass the same arguments"))
        elif problem:
            raise ValueError(problem)
        k, lws = num_nodes, local_world_size
        return cls._from_grid([[g * lws + j for j in range(lws)] for g in range(k)])

    @classmethod
    def from_env(cls) -> Topology:
        """The layout the launcher describes: ``LOCAL_WORLD_SIZE`` ranks per node and ``GROUP_RANK``
        (the node index; torchrun and ``accelerate launch`` set it, they do not set ``NODE_RANK``).

        Ranks must be node-major (torchrun's default). Every rank checks, through one all-gather, that
        all ranks agree on ``LOCAL_WORLD_SIZE``, that it divides the world size and that
        ``RANK == GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``; all ranks raise the same ``ValueError``
        otherwise. Collective: every rank must call it.
        """
        _require_initialized("Topology.from_env")
        world = dist.get_world_size()
        values, errors = {}, []
        for name in _ENV_NAMES:
            sources = (name, "NODE_RANK") if name == "GROUP_RANK" else (name,)
            raw = next((os.environ[n] for n in sources if os.environ.get(n, "") != ""), None)
            try:
                values[name] = None if raw is None else int(raw)
            except ValueError:
                errors.append(f"{name}={raw!r} is not an integer")
        # Gather first, then every rank judges the same table: all raise together, none hangs.
        table = gather((dist.get_rank(), values, errors), dist.group.WORLD)
        problem = _check_env_table(table, world)
        if problem:
            fix = "torchrun and accelerate set LOCAL_WORLD_SIZE, GROUP_RANK and LOCAL_RANK: with another launcher "
            fix += "export them, or use Topology.from_layout(num_nodes, local_world_size)"
            raise ValueError(explain(f"Topology.from_env: {problem}", fix))
        lws = table[0][1]["LOCAL_WORLD_SIZE"]
        return cls._from_grid([[g * lws + j for j in range(lws)] for g in range(world // lws)])

    @classmethod
    def from_device_mesh(cls, mesh) -> Topology:
        """From a 2-D ``DeviceMesh`` of shape ``(num_nodes, local_world_size)`` covering every rank,
        e.g. ``init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("node", "local"))``.

        Dimension 0 indexes nodes (``mesh.get_group(0)`` spans the inter-node ranks), dimension 1 the
        ranks of a node (``mesh.get_group(1)``). The topology builds its own groups over those same
        ranks, so the 1-bit traffic never interleaves with other users of the mesh. Collective: every
        rank calls it.
        """
        _require_initialized("Topology.from_device_mesh")
        grid = _mesh_grid(mesh, "Topology.from_device_mesh")  # grid[node][local] = global rank
        k = len(grid)
        rank = dist.get_rank()
        node = next(g for g in range(k) if rank in grid[g])
        local = grid[node].index(rank)
        intra_ranks = set(dist.get_process_group_ranks(mesh.get_group(1)))
        inter_ranks = set(dist.get_process_group_ranks(mesh.get_group(0)))
        if intra_ranks != set(grid[node]) or inter_ranks != {row[local] for row in grid}:
            raise ValueError("Topology.from_device_mesh: mesh.get_group(0/1) disagree with mesh.mesh")
        return cls._from_grid(grid)

    @classmethod
    def from_replicate_dim(cls, mesh) -> Topology:
        """This rank and its replicas across the nodes, each its own node: ``k`` nodes x 1 rank.

        ``mesh`` is the 2-D ``(replicate, shard)`` DeviceMesh of HSDP (dimension 0 spans the ``k`` nodes). The
        topology holds the ``k`` ranks that hold this rank's shard of every FSDP parameter, one per node: the group of
        Birder's 1-bit all-reduce in sharded training (``birder_hf.fsdp``); every byte counts as inter-node. A 1-D
        mesh of all ranks is one node (``k = 1``). Collective: every rank calls it.
        """
        _require_initialized("Topology.from_replicate_dim")
        if getattr(mesh, "ndim", None) == 1 and hasattr(mesh, "mesh"):
            grid = [mesh.mesh.tolist()]
            if sorted(grid[0]) != list(range(dist.get_world_size())):
                raise ValueError(f"Topology.from_replicate_dim: the 1-D mesh {grid[0]} must hold every rank once")
        else:
            grid = _mesh_grid(mesh, "Topology.from_replicate_dim")
        k, lws = len(grid), len(grid[0])
        rank = dist.get_rank()
        node = next(g for g in range(k) if rank in grid[g])
        local = grid[node].index(rank)
        columns = [[grid[g][j] for g in range(k)] for j in range(lws)]
        group, _ = dist.new_subgroups_by_enumeration(columns)
        return cls(
            rank=node,
            world_size=k,
            local_rank=0,
            local_world_size=1,
            node_rank=node,
            num_nodes=k,
            world_group=group,
            intra_group=None,
            inter_group=group if k > 1 else None,
            intra_ranks=(rank,),
            inter_ranks=tuple(columns[local]),
        )

    @classmethod
    def _from_grid(cls, grid: list[list[int]]) -> Topology:
        """The topology of ``grid[node][local] = global rank`` over the default group, with its own groups."""
        world, rank = dist.get_world_size(), dist.get_rank()
        k, lws = len(grid), len(grid[0])
        node = next(g for g in range(k) if rank in grid[g])
        local = grid[node].index(rank)
        intra = [list(row) for row in grid]
        inter = [[grid[g][j] for g in range(k)] for j in range(lws)]
        world_group = dist.new_group(list(range(world))) if world > 1 else dist.group.WORLD
        intra_group, inter_group = _build_group(intra, world_group), _build_group(inter, world_group)
        built = [g for g in (world_group, intra_group, inter_group) if g is not None and g is not dist.group.WORLD]
        return cls(rank=rank, world_size=world, local_rank=local, local_world_size=lws, node_rank=node, num_nodes=k,
                   world_group=world_group, intra_group=intra_group, inter_group=inter_group, intra_ranks=intra[node],
                   inter_ranks=inter[local], owned_groups=tuple({id(g): g for g in built}.values()))  # fmt: skip

    # -------------------------------------------------------------------------------------------- close
    def close(self) -> None:
        """Release the process groups this topology built, now (idempotent; every rank calls it after its last use).

        Waits until the backend's threads have finished with the 1-bit all-reduce's callbacks, then destroys the
        groups, joining their threads on this thread. Without it they live until the interpreter exits. A topology
        built over groups it did not create (``Topology.flat(group, dedicated=False)``) leaves them alone. Using a
        closed topology raises.
        """
        if self.closed:
            return
        wait_for_callbacks()  # the callbacks run on these groups' threads
        for group in self.owned_groups:
            try:
                dist.destroy_process_group(group)
            except ValueError:  # already destroyed (destroy_process_group() destroys every group)
                pass
        for name in ("world_group", "intra_group", "inter_group"):
            object.__setattr__(self, name, None)
        object.__setattr__(self, "owned_groups", ())
        object.__setattr__(self, "closed", True)
        untrack_groups(self)

    def check_open(self) -> None:
        """Raise ``RuntimeError`` if :meth:`close` released this topology's groups."""
        if self.closed:
            what = f"{self!r} was closed (its process groups are released)"
            raise RuntimeError(explain(what, "build a new topology, and a new hook state with it"))

    # ------------------------------------------------------------------------------------------- misc
    def __repr__(self) -> str:
        nodes = "node" if self.num_nodes == 1 else "nodes"
        ranks = "rank" if self.local_world_size == 1 else "ranks"
        return f"Topology({self.num_nodes} {nodes} x {self.local_world_size} {ranks}, rank {self.rank})"

    # Process groups are live handles: share them on copy, refuse to serialize them.
    def __copy__(self) -> Topology:
        return self

    def __deepcopy__(self, memo) -> Topology:
        return self

    def __reduce_ex__(self, protocol):
        what = "Topology holds process groups and cannot be pickled or checkpointed"
        raise TypeError(explain(what, "rebuild it after a restart (Topology.from_env(), ...), outside state_dict()"))


def _mesh_grid(mesh, where: str) -> list[list[int]]:
    """``grid[node][local] = global rank`` of a 2-D DeviceMesh covering every rank, ascending along both dimensions."""
    fix = "build one with init_device_mesh(device, (num_nodes, local_world_size))"
    if not hasattr(mesh, "mesh") or not hasattr(mesh, "get_group"):
        raise TypeError(explain(f"{where} expects a torch.distributed DeviceMesh, got {type(mesh).__name__}", fix))
    if getattr(mesh, "ndim", None) != 2:
        dims = f" of {mesh.ndim} dimensions" if hasattr(mesh, "ndim") else ""
        raise ValueError(
            explain(f"{where} expects a 2-D DeviceMesh (nodes x local), got {type(mesh).__name__}{dims}", fix)
        )
    world = dist.get_world_size()
    k, lws = mesh.size(0), mesh.size(1)
    if k * lws != world:
        raise ValueError(f"the mesh covers {k * lws} ranks but the default group has {world}; use a mesh of all")
    grid = mesh.mesh.tolist()
    # a group's ranks are ordered by global rank: the mesh must ascend along both dimensions for
    # those orders to be the mesh's local and node indices
    if any(sorted(row) != row for row in grid) or any(sorted(col) != list(col) for col in zip(*grid)):
        raise ValueError(explain(f"{where}: the mesh's ranks do not ascend along both dimensions", fix))
    return grid


def _check_env_table(table: list, world: int) -> str:
    """The first problem in every rank's ``(process-group rank, launcher values, parse errors)``, or ``""``."""
    for r, (dist_rank, row, errors) in enumerate(table):
        if errors:
            return f"on rank {r}, {errors[0]}"
        if row["LOCAL_WORLD_SIZE"] is None or row["GROUP_RANK"] is None:
            return f"rank {r} has no LOCAL_WORLD_SIZE or GROUP_RANK (nor NODE_RANK) in its environment"
        if row["RANK"] is not None and row["RANK"] != dist_rank:
            return f"RANK={row['RANK']} but the process group says rank {dist_rank}"
        if row["WORLD_SIZE"] is not None and row["WORLD_SIZE"] != world:
            return f"WORLD_SIZE={row['WORLD_SIZE']} but the process group has {world} ranks"
    sizes = sorted({row["LOCAL_WORLD_SIZE"] for _, row, _ in table})
    if len(sizes) > 1:
        return f"ranks disagree on LOCAL_WORLD_SIZE ({sizes}); every node must run the same number of ranks"
    lws = sizes[0]
    if lws < 1 or world % lws:
        return f"LOCAL_WORLD_SIZE={lws} does not divide the world size {world}"
    for r, (_, row, _) in enumerate(table):
        local = row["LOCAL_RANK"] if row["LOCAL_RANK"] is not None else r - row["GROUP_RANK"] * lws
        if row["GROUP_RANK"] * lws + local != r or not 0 <= local < lws:
            return (
                f"rank {r} has GROUP_RANK={row['GROUP_RANK']}, LOCAL_RANK={local} with LOCAL_WORLD_SIZE={lws}: "
                "ranks are not node-major"
            )
    return ""
