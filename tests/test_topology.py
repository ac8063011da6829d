import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from birder_hf.topology import Topology


def _describe(topo: Topology) -> dict:
    # what the groups actually connect: sum of global ranks over each group
    sums = {}
    for name in ("intra", "inter"):
        group = getattr(topo, f"{name}_group")
        t = torch.tensor([dist.get_rank()])
        if group is not None:
            dist.all_reduce(t, group=group)
        sums[name] = int(t)
    return {
        "repr": repr(topo),
        "fields": (topo.rank, topo.world_size, topo.local_rank, topo.local_world_size, topo.node_rank, topo.num_nodes),
        "ranks": (topo.intra_ranks, topo.inter_ranks),
        "sums": sums,
    }


def _layout_2x2(rank, world):
    return _describe(Topology.from_layout(2, 2))


def _env_2x2(rank, world):
    return _describe(Topology.from_env())


def _mesh_2x2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("node", "local"))
    return _describe(Topology.from_device_mesh(mesh))


def _expected_2x2(rank):
    node, local = divmod(rank, 2)
    intra, inter = (2 * node, 2 * node + 1), (local, local + 2)
    return {
        "repr": f"Topology(2 nodes x 2 ranks, rank {rank})",
        "fields": (rank, 4, local, 2, node, 2),
        "ranks": (intra, inter),
        "sums": {"intra": sum(intra), "inter": sum(inter)},
    }


@pytest.mark.parametrize(
    "fn, lws", [(_layout_2x2, None), (_env_2x2, 2), (_mesh_2x2, None)], ids=["layout", "env", "mesh"]
)
def test_two_nodes_of_two(fn, lws):
    results = run_distributed(fn, 4, local_world_size=lws)
    for rank, got in enumerate(results):
        assert got == _expected_2x2(rank)


def _flat_and_degenerate(rank, world):
    flat = Topology.flat()
    ones = Topology.from_layout(world, 1)  # every rank its own node
    return _describe(flat), _describe(ones)


def test_flat_and_one_rank_per_node():
    for rank, (flat, ones) in enumerate(run_distributed(_flat_and_degenerate, 2)):
        assert flat["repr"] == f"Topology(1 node x 2 ranks, rank {rank})"
        assert flat["fields"] == (rank, 2, rank, 2, 0, 1)
        assert flat["sums"] == {"intra": 1, "inter": rank}  # inter group is just this rank
        assert ones["fields"] == (rank, 2, 0, 1, rank, 2)
        assert ones["sums"] == {"intra": rank, "inter": 1}


def _flat_subgroup(rank, world):
    from birder_hf.collectives import onebit_all_reduce

    sub = dist.new_group([1, 3])  # every rank creates it; only members build the topology on it
    if rank not in (1, 3):
        return None
    topo = Topology.flat(sub)
    d = onebit_all_reduce(torch.full((10,), 1.0 if rank == 1 else -1.0), topology=topo, keys=0)
    return repr(topo), topo.intra_ranks, topo.world_group is not sub, d


def test_flat_over_a_subgroup():
    res = run_distributed(_flat_subgroup, 4)
    assert res[0] is None and res[2] is None
    assert res[1][:3] == ("Topology(1 node x 2 ranks, rank 0)", (1, 3), True)
    assert res[3][:3] == ("Topology(1 node x 2 ranks, rank 1)", (1, 3), True)
    assert torch.equal(res[1][3], res[3][3]) and torch.equal(res[1][3], torch.zeros(10))  # votes +1 and -1


def _catch(fn):
    def run(rank, world):
        try:
            fn()
        except Exception as exc:  # the error each rank saw
            return type(exc).__name__, str(exc)
        return None

    return run


@pytest.mark.parametrize(
    "env, needle",
    [
        (lambda r: {"LOCAL_WORLD_SIZE": 3, "GROUP_RANK": r // 3, "LOCAL_RANK": r % 3}, "does not divide"),
        (lambda r: {"LOCAL_WORLD_SIZE": 2 if r < 2 else 1}, "disagree on LOCAL_WORLD_SIZE"),
        (lambda r: {"GROUP_RANK": ""}, "GROUP_RANK"),
        (lambda r: {"GROUP_RANK": 1 - r // 2}, "node-major"),
        (lambda r: {"WORLD_SIZE": 8}, "WORLD_SIZE=8"),
    ],
    ids=["not-dividing", "disagree", "missing", "not-node-major", "wrong-world"],
)
def test_from_env_errors_raise_on_every_rank(env, needle):
    results = run_distributed(_catch(Topology.from_env), 4, local_world_size=2, env=env)
    for got in results:
        assert got is not None and got[0] == "ValueError", got
        assert needle in got[1] and "from_layout" in got[1]


def test_from_layout_must_cover_the_world():
    for got in run_distributed(_catch(lambda: Topology.from_layout(3, 1)), 4):
        assert got[0] == "ValueError" and "divides 4" in got[1]


def test_needs_initialized_process_group():
    assert not dist.is_initialized()
    for ctor in (Topology.flat, Topology.from_env, lambda: Topology.from_layout(1, 1)):
        with pytest.raises(RuntimeError, match="init_process_group"):
            ctor()


def test_not_picklable_but_copy_shares():
    topo = Topology(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        world_group=None,
        intra_group=None,
        inter_group=None,
        intra_ranks=(0,),
        inter_ranks=(0,),
    )
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(topo)
    with pytest.raises(TypeError):
        torch.save({"topology": topo}, "/dev/null")
    assert copy.deepcopy(topo) is topo and copy.copy(topo) is topo
    with pytest.raises(AttributeError):
        topo.extra = 1  # __slots__


# ----------------------------------------------------------------------- the multi-rank harness itself


def _rank0_fails(rank, world):
    if rank == 0:
        raise KeyError("boom on rank 0")
    dist.barrier()  # rank 1 waits for a peer that is gone: the harness must kill it


def _rank1_hangs(rank, world):
    if rank == 1:
        import time

        time.sleep(600)
    return rank


def test_harness_reports_tracebacks_and_kills_stragglers(monkeypatch):
    import _dist

    monkeypatch.setattr(_dist, "_GRACE_S", 0.5)
    with pytest.raises(RuntimeError, match="(?s)rank 0.*KeyError: 'boom on rank 0'"):
        run_distributed(_rank0_fails, 2, timeout=60)
    with pytest.raises(RuntimeError, match=r"ranks \[(0, )?1\] did not finish within 2 s and were killed"):
        run_distributed(_rank1_hangs, 2, timeout=2)


def test_from_replicate_dim_holds_this_ranks_replicas_one_per_node():
    def fn(rank, world):
        from torch.distributed.device_mesh import init_device_mesh

        t = Topology.from_replicate_dim(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
        flat = Topology.from_replicate_dim(init_device_mesh("cpu", (4,)))
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=t.world_group)  # the replicas of this rank's shard: ranks j and j + 2
        layout = (t.rank, t.world_size, t.num_nodes, t.local_world_size, t.node_rank, t.inter_ranks, t.intra_ranks)
        return layout, x.item(), (flat.num_nodes, flat.world_size, flat.inter_group)

    res = run_distributed(fn, 4)
    for rank, (layout, total, flat) in enumerate(res):
        node, local = divmod(rank, 2)
        assert layout == (node, 2, 2, 1, node, (local, local + 2), (rank,))
        assert total == 2 * local + 2  # local + (local + 2)
        assert flat == (1, 1, None)  # a 1-D mesh: one node, this rank alone, nothing to exchange
