import math

import pytest
import torch
from _dist import run_distributed

from birder_hf.collectives import CommStats, expected_bytes, onebit_all_reduce
from birder_hf.quantize import (
    STAGE_INTER_SHARD,
    STAGE_NODE,
    STAGE_SHARD,
    STAGE_WORKER,
    BitKeys,
    quantize_bits,
    unpack_bits,
)
from birder_hf.topology import Topology

# ------------------------------------------------------------------------------------------ reference


def _bits(keys, v, start, stage, who, reflect=False):
    return unpack_bits(keys.quantize_pack(v, start, stage, who, reflect=reflect), v.numel()).float()


def _pair(member):
    # antithetic pairs: members 2i and 2i+1 (ranks, or nodes) draw with pair i's key, the odd one reflected
    return member // 2, member % 2 == 1


def _mean(votes, work=torch.float32):
    # exact mean of 0/1 votes as +-1, computed as the library does: (2c - m) / m in fp32 (fp64 for an fp64 output)
    return (2 * torch.stack(votes).to(work).sum(0) - len(votes)) / len(votes)


def simulate(method, us, keys, num_nodes, lws, inter_method="allgather", work=torch.float32):
    """Single-process reference of every method (DeepSpeed's torch_sim idea), fp32."""
    n, numel = len(us), us[0].numel()
    if method == "hierarchical" and num_nodes == 1 and 1 + lws.bit_length() >= lws:
        method = "allgather"  # one node of <= 4 ranks: the same exact mean, fewer bytes
    align = {"allgather": 8, "scatter_gather": 8 * n, "hierarchical": 8 * lws}[method]
    if method == "hierarchical" and inter_method == "scatter_gather":
        align *= num_nodes
    padded = -(-numel // align) * align

    def pad(v):  # padding votes -1 (bit 0)
        return torch.cat([v, v.new_zeros(padded - numel)])

    votes = [pad(_bits(keys, u.reshape(-1), 0, STAGE_WORKER, *_pair(r))) for r, u in enumerate(us)]
    if method == "allgather" or (method == "hierarchical" and num_nodes == 1):
        d = _mean(votes, work)  # the exact vote mean, rounded once in the output's work dtype
    elif method == "scatter_gather":
        v, s = _mean(votes), padded // n
        d = torch.cat([_bits(keys, v[i * s : (i + 1) * s], i * s, STAGE_SHARD, 0) for i in range(n)]) * 2 - 1
    else:
        s1 = padded // lws
        node_bits = []
        for g in range(num_nodes):
            m = _mean(votes[g * lws : (g + 1) * lws])
            node_bits.append(
                torch.cat([_bits(keys, m[j * s1 : (j + 1) * s1], j * s1, STAGE_NODE, *_pair(g)) for j in range(lws)])
            )
        w = _mean(node_bits)
        if inter_method == "allgather":
            d = w
        else:
            s2 = s1 // num_nodes
            d = torch.cat(
                [_bits(keys, w[i * s2 : (i + 1) * s2], i * s2, STAGE_INTER_SHARD, 0) for i in range(padded // s2)]
            )
            d = d * 2 - 1
    return d[:numel]


# --------------------------------------------------------------------------------------------- ranks

CASES = [  # (length, dtype, chunk_numel)
    (1, torch.float32, None),
    (13, torch.float64, None),
    (7, torch.float16, None),
    (1001, torch.float32, None),
    (1001, torch.float32, 64),
    (1001, torch.bfloat16, 200),
]


def _u(rank, length, dtype):
    g = torch.Generator().manual_seed(1000 * rank + length)
    u = torch.rand(length, generator=g, dtype=torch.float64) * 2 - 1
    u[:3] = torch.tensor([1.0, -1.0, 0.0])[: min(3, length)]
    return u.to(dtype)


def _keys(length):
    if length < 100:
        return 123
    return BitKeys(seed=5, step=9, segment_ids=[7, 3, 11], segment_sizes=[500, 1, length - 501])


def _topology(layout):
    return Topology.flat() if layout is None else Topology.from_layout(*layout)


def _all_cases(rank, world, layout, method, inter_method):
    topo = _topology(layout)
    out = []
    for length, dtype, chunk in CASES:
        stats = CommStats()
        u = _u(rank, length, dtype)
        d = onebit_all_reduce(
            u.view(1, -1) if length == 13 else u,
            topology=topo,
            method=method,
            inter_method=inter_method,
            keys=_keys(length),
            chunk_numel=chunk,
            stats=stats,
        )
        out.append((u, d, stats))
    return out


CONFIGS = [  # (world, layout, method, inter_method)
    (1, None, "allgather", "allgather"),
    (1, None, "scatter_gather", "allgather"),
    (2, None, "allgather", "allgather"),
    (2, None, "scatter_gather", "allgather"),
    (2, (2, 1), "hierarchical", "allgather"),
    (2, (1, 2), "hierarchical", "scatter_gather"),
    (4, None, "allgather", "allgather"),
    (4, None, "scatter_gather", "allgather"),
    (4, (2, 2), "allgather", "allgather"),
    (4, (2, 2), "hierarchical", "allgather"),
    (4, (2, 2), "hierarchical", "scatter_gather"),
    (4, (4, 1), "hierarchical", "scatter_gather"),
    (4, (1, 4), "hierarchical", "allgather"),
    (5, (1, 5), "hierarchical", "allgather"),  # one node of 5: the vote counts path
]


@pytest.mark.parametrize("world, layout, method, inter_method", CONFIGS)
def test_identical_on_every_rank_and_matches_reference(world, layout, method, inter_method):
    results = run_distributed(_all_cases, world, layout, method, inter_method)
    num_nodes, lws = layout or (1, world)
    for i, (length, dtype, _chunk) in enumerate(CASES):
        d0 = results[0][i][1]
        assert d0.dtype == dtype and d0.shape == ((1, length) if length == 13 else (length,))
        for r in range(world):
            assert torch.equal(results[r][i][1], d0), f"rank {r} differs, case {i}"
        us = [results[r][i][0] for r in range(world)]
        ref = simulate(
            method,
            us,
            _keys(length) if length >= 100 else BitKeys.single(123, 0, length),
            num_nodes,
            lws,
            inter_method,
            work=torch.float64 if dtype == torch.float64 else torch.float32,
        )
        assert torch.equal(d0.reshape(-1), ref.to(dtype)), f"case {i}: differs from the reference"
        # bytes sent: as predicted, on every rank, whatever the chunking
        exp = expected_bytes(method, length, (num_nodes, lws), inter_method=inter_method)
        for r in range(world):
            st = results[r][i][2]
            got = {k: getattr(st, k) for k in exp}
            assert got == exp and st.calls == 1, (r, i, got, exp)


def _exact_votes(rank, world):
    keys = BitKeys(seed=1, step=2, segment_ids=[4, 5], segment_sizes=[300, 700])
    u = _u(rank, 1000, torch.float32)
    d = onebit_all_reduce(u, method="allgather", keys=keys)
    # out=: written in place, even over u itself (u is read only before the call returns), async too
    own = u.clone().view(10, 100)
    same = onebit_all_reduce(own, method="allgather", keys=keys, out=own)
    fut = onebit_all_reduce(u, method="allgather", keys=keys, out=torch.empty(1000), async_op=True)
    assert same is own and torch.equal(own.view(-1), d) and torch.equal(fut.wait(), d)
    return u, d


def test_allgather_is_the_exact_mean_of_the_votes():
    results = run_distributed(_exact_votes, 4)
    keys = BitKeys(seed=1, step=2, segment_ids=[4, 5], segment_sizes=[300, 700])
    plus = torch.zeros(1000)
    for r, (u, _) in enumerate(results):  # votes recomputed from the per-segment keys
        plus += torch.cat(
            [
                quantize_bits(u[:300], keys.key(0, STAGE_WORKER, r // 2), reflect=r % 2 == 1),
                quantize_bits(u[300:], keys.key(1, STAGE_WORKER, r // 2), reflect=r % 2 == 1),
            ]
        )
    assert torch.equal(results[0][1], (2 * plus - 4) / 4)
    assert set(results[0][1].tolist()) <= {-1.0, -0.5, 0.0, 0.5, 1.0}


# ------------------------------------------------------------------------------------- unbiasedness

M, T, SEEDS = 8, 7000, 8  # 8 distinct values per rank, each repeated T times, over SEEDS keys


def _unbiased(rank, world, layout, method, inter_method):
    base = torch.linspace(-0.9, 0.9, M).roll(3 * rank) * (1 - 0.1 * rank)
    u = base.repeat(T)
    topo = _topology(layout)
    total, squares = torch.zeros(M, dtype=torch.float64), torch.zeros(M, dtype=torch.float64)
    for seed in range(SEEDS):
        d = onebit_all_reduce(u, topology=topo, method=method, inter_method=inter_method, keys=seed).double()
        total += d.view(T, M).sum(0)
        squares += d.view(T, M).square().sum(0)
    return base, total / (T * SEEDS), squares / (T * SEEDS)


def _independent_variance(us, layout, method, inter_method):
    # Var(d) had every rank (and node) drawn independently: a single +-1 result has 1 - mu^2 whatever the coupling;
    # a mean of m independent +-1 votes (or node bits) with means mu_i has sum(1 - mu_i^2) / m^2
    mu = us.mean(0)
    if method == "scatter_gather" or inter_method == "scatter_gather":
        return 1 - mu**2
    node_means = us.view(layout[0], layout[1], -1).mean(1) if method == "hierarchical" else us
    return (1 - node_means**2).sum(0) / node_means.shape[0] ** 2


@pytest.mark.parametrize(
    "layout, method, inter_method",
    [(None, "allgather", "allgather"), (None, "scatter_gather", "allgather")]
    + [((2, 2), "hierarchical", im) for im in ("allgather", "scatter_gather")],
)
def test_unbiased_and_never_more_variance_than_independent_draws(layout, method, inter_method):
    results = run_distributed(_unbiased, 4, layout, method, inter_method)
    us = torch.stack([b for b, _, _ in results]).double()
    mu = us.mean(0)
    avg, second = results[0][1], results[0][2]
    # d in [-1, 1] with mean mu => Var(d) <= 1 - mu^2 per element; elements and seeds are independent,
    # so the average of N = T * SEEDS draws has standard error <= sqrt((1 - mu^2) / N). Tolerance: 5 SE
    # plus the codec's bias (< 2^-23 per stage).
    n = T * SEEDS
    tol = 5 * torch.sqrt((1 - mu**2) / n) + 3 * 2**-23
    assert torch.all((avg - mu).abs() <= tol), (avg - mu, tol)
    # the variance: (d - mu)^2 <= 4, so the sample variance has standard error <= 2 sqrt(Var / N)
    var = second - avg**2
    independent = _independent_variance(us, layout or (1, 4), method, inter_method)
    var_tol = 5 * 2 * torch.sqrt(independent / n) + 1e-6
    assert torch.all(var <= independent + var_tol), (var, independent)
    if method == "allgather":
        # antithetic pairs (0, 1), (2, 3): Var(q_a + q_b) = |s| (2 - |s|), s = u_a + u_b (quantize.py), exactly
        s = us[0::2] + us[1::2]
        exact = (s.abs() * (2 - s.abs())).sum(0) / 16
        assert torch.all((var - exact).abs() <= 5 * 2 * torch.sqrt(exact / n) + 1e-6), (var, exact)
        assert (independent - exact).max() > 0.1  # well apart: independent draws would fail the line above
    elif method == "scatter_gather" or inter_method == "scatter_gather":
        assert torch.all((var - independent).abs() <= var_tol)  # one +-1 bit: 1 - mu^2, the coupling cannot matter


# ---------------------------------------------------------------------------- zero u, out-of-range u

ZERO_CASES = [  # (layout, method, inter_method, d = 0 exactly where u = 0 on every rank?)
    (None, "allgather", "allgather", True),
    (None, "scatter_gather", "allgather", False),  # one +-1 bit: cannot express 0
    ((2, 2), "allgather", "allgather", True),
    ((2, 2), "hierarchical", "allgather", True),  # L, k even: zero node means, then zero node pairs
    ((2, 2), "hierarchical", "scatter_gather", False),
    ((4, 1), "hierarchical", "allgather", True),  # L = 1: the rank pairs are the node pairs
    ((1, 4), "hierarchical", "scatter_gather", True),  # one node: its exact vote mean
]
EDGE_U = [300.0, -300.0, 256.0, -256.0, float("inf"), -float("inf"), float("nan"), 1e30, -1e30, 1.0, -1.0]
EDGE_D = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0]  # clamped; NaN votes -1


def _zero_and_edges(rank, world, cases):
    g = torch.Generator().manual_seed(rank)
    u = torch.rand(3000, generator=g) * 2 - 1
    u[::3] = 0.0  # 0 on every rank: a gradient that has been 0 since the start
    u[1::3][rank::world] = 0.0  # 0 on one rank only (no claim)
    edge = torch.tensor(EDGE_U).repeat(7)
    out = []
    for layout, method, inter_method, _ in cases:
        kw = dict(topology=_topology(layout), method=method, inter_method=inter_method)
        d = [onebit_all_reduce(u, keys=seed, **kw)[::3] for seed in range(4)]
        out.append((torch.stack(d), onebit_all_reduce(edge, keys=5, **kw)))
    return out


def test_zero_u_on_every_rank_gives_zero_where_the_method_can_express_it():
    for res in run_distributed(_zero_and_edges, 4, ZERO_CASES):
        for (d_zero, d_edge), (layout, method, inter_method, exact) in zip(res, ZERO_CASES, strict=True):
            case = (layout, method, inter_method)
            if exact:
                assert torch.all(d_zero == 0), case
            else:  # a fair coin per element: +-1, both signs
                assert set(d_zero.unique().tolist()) == {-1.0, 1.0}, case
            # |u| >= 256 and +-inf clamp to +-1, NaN votes -1 (every rank sends the same, so d is that vote)
            assert d_edge.tolist() == EDGE_D * 7, case


def test_odd_nodes_of_an_even_count_still_cancel():
    # 2 nodes of 3: pair (2, 3) straddles the nodes, whose means are then +-1/3 and -+1/3; the two nodes re-quantize
    # them as a pair, which cancels but for the codec's resolution (2^-24 per element): 0 on all 4000 elements here
    case = [((2, 3), "hierarchical", "allgather", True)]
    for ((d_zero, d_edge),) in run_distributed(_zero_and_edges, 6, case):
        assert torch.all(d_zero == 0) and d_edge.tolist() == EDGE_D * 7


def test_odd_world_size_leaves_one_fair_coin():
    # the last rank has no partner: where u = 0 everywhere, d = +-1/3 (node stage of 3 x 1 alike)
    cases = [(None, "allgather", "allgather", False), ((3, 1), "hierarchical", "allgather", False)]
    for res in run_distributed(_zero_and_edges, 3, cases):
        for d_zero, d_edge in res:
            assert set(d_zero.unique().tolist()) == {float(torch.tensor(v)) for v in (-1 / 3, 1 / 3)}
            assert d_edge.tolist() == EDGE_D * 7


# ------------------------------------------------------------------------- layout and chunk invariance


def _invariance(rank, world, layout, method, inter_method):
    topo = _topology(layout)
    sizes = {0: 37, 1: 400, 2: 5}
    parts = {i: _u(rank, s, torch.float32) for i, s in sizes.items()}
    outs = []
    for order in ([0, 1, 2], [2, 0, 1]):  # a DDP bucket rebuild reorders parameters
        keys = BitKeys(seed=3, step=4, segment_ids=order, segment_sizes=[sizes[i] for i in order])
        u = torch.cat([parts[i] for i in order])
        for chunk in (None, 8 * world, 24 * world, 10**6):
            d = onebit_all_reduce(
                u, topology=topo, method=method, inter_method=inter_method, keys=keys, chunk_numel=chunk
            )
            outs.append(dict(zip(order, d.split([sizes[i] for i in order]), strict=True)))
    return outs


@pytest.mark.parametrize(
    "layout, method, inter_method",
    [(None, "allgather", "allgather"), (None, "scatter_gather", "allgather"), ((2, 2), "hierarchical", "allgather")]
    + [((2, 2), "hierarchical", "scatter_gather")],
)
def test_independent_of_segment_layout_and_chunking(layout, method, inter_method):
    outs = run_distributed(_invariance, 4, layout, method, inter_method)[0]
    for other in outs[1:]:
        for i in range(3):
            assert torch.equal(other[i], outs[0][i])


# ---------------------------------------------------------------------------------------------- async


def _async(rank, world, layout, method, inter_method):
    topo = _topology(layout)
    inputs = [_u(rank, n, torch.float32) for n in (1001, 64, 3000, 5, 999, 2048, 77, 1500)]
    sync = [
        onebit_all_reduce(u, topology=topo, method=method, inter_method=inter_method, keys=i)
        for i, u in enumerate(inputs)
    ]
    # all in flight at once, some chunked, one chained with .then(), like DDP buckets
    futs = [
        onebit_all_reduce(
            u,
            topology=topo,
            method=method,
            inter_method=inter_method,
            keys=i,
            async_op=True,
            chunk_numel=256 if i % 2 else None,
        )
        for i, u in enumerate(inputs)
    ]
    doubled = futs[0].then(lambda f: f.value() * 2)
    # meanwhile other collectives on the default group (DDP's find_unused_parameters all-reduce does
    # this): the topology's own groups keep them apart from the callbacks' collectives
    assert topo.world_group is not torch.distributed.group.WORLD
    sums = []
    for i in range(20):
        t = torch.tensor([float(rank + i)])
        torch.distributed.all_reduce(t)
        sums.append(t.item())
    assert sums == [sum(r + i for r in range(world)) for i in range(20)]
    # a sync call on the same topology waits for the pending ones (keeps the collective order)
    mid = onebit_all_reduce(inputs[1], topology=topo, method=method, inter_method=inter_method, keys=1)
    values = [f.wait() for f in futs]
    return sync, values, doubled.wait(), mid


@pytest.mark.parametrize(
    "layout, method, inter_method", [(None, "allgather", "allgather"), ((2, 2), "hierarchical", "scatter_gather")]
)
def test_async_matches_sync(layout, method, inter_method):
    results = run_distributed(_async, 4, layout, method, inter_method)
    for sync, values, doubled, mid in results:
        assert all(isinstance(v, torch.Tensor) for v in values)
        for a, b in zip(sync, values, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(doubled, 2 * sync[0]) and torch.equal(mid, sync[1])
    for r in range(1, 4):
        assert all(torch.equal(a, b) for a, b in zip(results[r][1], results[0][1], strict=True))


def _returns_before_peers(rank, world, layout, method):
    topo = Topology.from_layout(*layout)
    u = torch.linspace(-1, 1, 4096)
    sync = onebit_all_reduce(u, topology=topo, method=method, keys=3)  # (a first call checks the ranks agree)
    if rank == 0:  # the others call only after this rank's call has returned: a blocking call would deadlock
        fut = onebit_all_reduce(u, topology=topo, method=method, keys=3, async_op=True)
        pending = not fut.done()
        torch.distributed.barrier()
    else:
        torch.distributed.barrier()
        fut = onebit_all_reduce(u, topology=topo, method=method, keys=3, async_op=True)
        pending = True
    return pending, fut.wait(), sync


@pytest.mark.parametrize("layout, method", [((2, 1), "hierarchical"), ((2, 2), "hierarchical"), ((1, 2), "allgather")])
def test_async_call_returns_before_its_peers_have_called(layout, method):
    # an async call only starts its exchange: with one rank per node, hierarchical used to run its inter-node step
    # inside the call (the DDP hook, so backward waited for the network)
    results = run_distributed(_returns_before_peers, layout[0] * layout[1], layout, method, timeout=60)
    assert all(pending for pending, _, _ in results)
    for _, d, sync in results:
        assert torch.equal(d, sync) and torch.equal(d, results[0][1])


# ------------------------------------------------------------------------------------------- bytes


@pytest.mark.parametrize("layout", [(2, 2), (4, 8), (16, 2), (1, 8), (8, 1)])
def test_expected_bytes_follow_the_design_table(layout):
    k, lws = layout
    n, d = k * lws, 8 * k * lws * 1000  # d a multiple of every alignment: no padding
    fp32 = 2 * (n - 1) / n * 4 * d
    ag = expected_bytes("allgather", d, layout)
    assert ag["intra_node_bytes"] + ag["inter_node_bytes"] == (n - 1) * d / 8
    assert ag["fp32_allreduce_bytes"] == fp32
    sg = expected_bytes("scatter_gather", d, layout)
    assert sg["intra_node_bytes"] + sg["inter_node_bytes"] == 2 * (n - 1) / n * d / 8
    assert sg["inter_node_bytes"] == (n - lws) * 2 * d / (8 * n)
    h_ag = expected_bytes("hierarchical", d, layout)
    assert h_ag["inter_node_bytes"] == (k - 1) * d / (8 * lws)
    h_sg = expected_bytes("hierarchical", d, layout, inter_method="scatter_gather")
    assert h_sg["inter_node_bytes"] == 2 * (k - 1) / k * d / (8 * lws) <= 2 * d / (8 * lws)
    # intra: the votes' all-to-all, then the shard results (+-1 bits; or the vote counts' binary digits)
    # (one node: the exact mean of its L votes, whichever inter_method: the cheaper of allgather and the vote counts)
    step4 = d / 8 * (k.bit_length() if k > 1 else lws.bit_length())
    h_ag_intra = (lws - 1) / lws * (d / 8 + step4)
    if k == 1:
        h_ag_intra = min(h_ag_intra, (lws - 1) * d / 8)
    assert h_ag["intra_node_bytes"] == h_ag_intra
    assert h_sg["intra_node_bytes"] == (h_ag_intra if k == 1 else 2 * (lws - 1) / lws * d / 8)
    # against the fp32 ring all-reduce: allgather's volume grows with n (ratio 64/n), scatter_gather's does not
    assert fp32 / (ag["intra_node_bytes"] + ag["inter_node_bytes"]) == pytest.approx(64 / n)
    assert fp32 / (sg["intra_node_bytes"] + sg["inter_node_bytes"]) == pytest.approx(32)


def _three_by_three(rank, world):
    topo = Topology.from_layout(3, 3)
    out = []
    for inter_method in ("allgather", "scatter_gather"):
        u, stats = _u(rank, 500, torch.float32), CommStats()
        d = onebit_all_reduce(u, topology=topo, method="hierarchical", inter_method=inter_method, keys=8, stats=stats)
        out.append((u, d, stats))
    return out


def test_hierarchical_three_nodes_of_three():
    # non-power-of-two k and L: means in thirds, 2 count digits in step 4
    results = run_distributed(_three_by_three, 9)
    for i, inter_method in enumerate(("allgather", "scatter_gather")):
        us = [res[i][0] for res in results]
        ref = simulate("hierarchical", us, BitKeys.single(8, 0, 500), 3, 3, inter_method)
        exp = expected_bytes("hierarchical", 500, (3, 3), inter_method=inter_method)
        for res in results:
            _, d, stats = res[i]
            assert torch.equal(d, ref)
            assert {k: getattr(stats, k) for k in exp} == exp
    thirds = {-1.0, -1 / 3, 1 / 3, 1.0}
    assert set(results[0][0][1].tolist()) <= {float(torch.tensor(v)) for v in thirds}


def test_comm_stats():
    st = CommStats(intra_node_bytes=10, inter_node_bytes=30, calls=2, collectives=3, fp32_allreduce_bytes=400)
    assert st.total_bytes == 40 and st.compression_ratio == 10
    assert st.as_dict("x/")["x/compression_ratio"] == 10 and st.as_dict()["comm/calls"] == 2
    st.reset()
    assert st.total_bytes == 0 and st.compression_ratio == 0.0 and st.calls == 0
    st.fp32_allreduce_bytes = 1
    assert math.isinf(st.compression_ratio)


# ------------------------------------------------------------------------------------------ validation


def test_bad_arguments_before_any_communication():
    u = torch.zeros(8)
    with pytest.raises(ValueError, match="allgather, scatter_gather, hierarchical"):
        onebit_all_reduce(u, method="ring")
    with pytest.raises(ValueError, match="inter_method"):
        onebit_all_reduce(u, method="hierarchical", inter_method="tree")
    with pytest.raises(TypeError, match="floating-point"):
        onebit_all_reduce(torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="valid methods"):
        expected_bytes("ring", 8, (1, 1))
    with pytest.raises(RuntimeError, match="init_process_group"):
        onebit_all_reduce(u)


def _bad_in_group(rank, world):
    errors = []
    topo = Topology.flat()
    for kwargs in (
        {"u": torch.zeros(8), "keys": BitKeys.single(0, 0, 9)},
        {"u": torch.zeros(8, device="meta")},
        {"u": torch.zeros(8), "topology": "flat"},
        {"u": torch.zeros(8), "keys": 1.5},
        {"u": torch.zeros(8), "out": torch.zeros(8, dtype=torch.float64)},
    ):
        kwargs.setdefault("topology", topo)
        try:
            onebit_all_reduce(kwargs.pop("u"), **kwargs)
            errors.append(None)
        except Exception as exc:
            errors.append((type(exc).__name__, str(exc)))
    return errors


def test_bad_arguments_in_a_group():
    for errors in run_distributed(_bad_in_group, 2):
        (e1, m1), (e2, m2), (e3, m3), (e4, m4), (e5, m5) = errors
        assert e1 == "ValueError" and "describe 9 elements" in m1
        assert e2 == "ValueError" and "meta" in m2 and "gloo" in m2
        assert e3 == "TypeError" and "Topology" in m3
        assert e4 == "TypeError" and "keys" in m4
        assert e5 == "ValueError" and "out must be" in m5 and "float64" in m5


# ------------------------------------------------------------------------------------------ one node, hierarchical
def _one_node_variance(rank, world):
    u = torch.full((1 << 16,), 0.3)
    d = onebit_all_reduce(u, topology=Topology.flat(), method="hierarchical", keys=11)
    return d.mean().item(), d.var().item()


def test_hierarchical_on_one_node_keeps_the_exact_vote_mean():
    # the exact mean of 2 votes, each +-1 with mean 0.3, drawn as an antithetic pair: d is 1 with probability 0.3,
    # else 0, so var = |u| - u^2 = 0.21 (independent votes: (1 - 0.09) / 2 = 0.455); re-quantizing it to +-1 (what
    # hierarchical did on one node) gives 1 - 0.09 = 0.91. 65536 elements: standard error of the variance ~0.002
    (mean, var), _ = run_distributed(_one_node_variance, 2)
    assert abs(mean - 0.3) < 0.02 and abs(var - 0.21) < 0.02, (mean, var)
