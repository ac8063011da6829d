"""A coordinate that stops receiving gradient stops moving (DESIGN.md invariant 7; issue 25), on every path.

m and b decay by the same beta when g = 0, so the paper's u = m / b keeps its last value: a coordinate that saw a
gradient and then only zeros moves by lr every step, in its last direction, without end. ``lazy=True`` (opt-in)
takes u = 0 where this step's gradient is exactly 0: such a coordinate does not vote, and the methods that can
express 0 (one process; ``allgather`` with an even world size; ``hierarchical`` with ``inter_method="allgather"`` and
even or unit node counts and sizes) give it d = 0.

**The bound checked here**: with weight decay 0, a coordinate whose gradient is exactly 0 on every rank after its
first ``K`` steps moves by at most ``K * lr`` in total, however many steps follow (here ``K = 2``, 40 steps after).
``lazy=False`` (the paper's literal update) moves it by lr per step: 42 lr here. Methods whose result is one +-1 bit
(``scatter_gather``, ``inter_method="scatter_gather"``) cannot say 0: there such a coordinate random-walks by +-lr
per step (no drift: mean 0); the test bounds it by ``K lr + 4 lr sqrt(T - K)`` (4 standard deviations).
"""

import math

import pytest
import torch
from _dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from birder_hf import Birder, Topology, attach_ddp_hook
from birder_hf.reference import BirderReference

N, STALE, K, T, LR = 16, 4, 2, 42, 0.01  # 16 coordinates, the first 4 get a gradient on the first K of T steps only
BOUND = K * LR * (1 + 1e-5)  # float32 rounding of x - lr * d
WALK_BOUND = K * LR + 4 * LR * math.sqrt(T - K)  # one +-1 bit: a fair coin per step after K


def _grad(rank: int, step: int) -> torch.Tensor:
    """This rank's gradient at ``step`` (0-based): coordinates 0..3 get (1, -1, 0.5, -2) scaled per rank for the
    first K steps, then exactly 0; the others get a fresh random gradient every step."""
    g = torch.randn(N, generator=torch.Generator().manual_seed(100 * rank + step))
    g[:STALE] = torch.tensor([1.0, -1.0, 0.5, -2.0]) * (1 + rank) if step < K else 0.0
    return g


class _Linear(torch.nn.Module):
    """loss = <w, c>: the gradient of w is exactly c."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, N))

    def forward(self, c):
        return (self.w * c).sum()


def _moves(x0: torch.Tensor, x: torch.Tensor) -> list[float]:
    return (x.detach() - x0).abs()[:STALE].tolist()


# ------------------------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("foreach", [False, True])
def test_one_process_stale_coordinate_moves_at_most_k_lr(amsgrad, foreach):
    moved = {}
    for lazy in (True, False):
        x = torch.nn.Parameter(torch.linspace(-1, 1, N))
        x0 = x.detach().clone()
        opt = Birder([x], lr=LR, seed=3, amsgrad=amsgrad, lazy=lazy, foreach=foreach)
        for t in range(T):
            x.grad = _grad(0, t)
            opt.step()
        moved[lazy] = _moves(x0, x)
    assert max(moved[True]) <= BOUND, moved[True]
    if not amsgrad:  # the paper's literal update: lr every step, in the last direction
        assert min(moved[False]) >= 0.9 * T * LR, moved[False]


def test_issue_example_literal_drifts_200_lr_and_lazy_stops():
    # the issue's numbers: gradient (1, -1, 0.5, 0) at step 0 and zeros after, lr 1e-3, 200 steps
    out = {}
    for lazy in (False, True):
        p = torch.nn.Parameter(torch.zeros(4))
        opt = Birder([p], lr=1e-3, seed=0, lazy=lazy)
        for t in range(200):
            p.grad = torch.tensor([1.0, -1.0, 0.5, 0.0]) if t == 0 else torch.zeros(4)
            opt.step()
        out[lazy] = p.detach()
    torch.testing.assert_close(out[False], torch.tensor([-0.2, 0.2, -0.2, 0.0]), atol=1e-5, rtol=0)
    assert out[True].abs().max().item() <= 1e-3 * (1 + 1e-5) and out[True][3] == 0


@pytest.mark.parametrize("lazy", [True, False])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_reference_agrees_with_zero_gradients(lazy, amsgrad):
    # BirderReference (paper-literal arithmetic, one line per rule) takes the same option, bit for bit
    # (float64: the two write x - lr (d + wd x) in different orders, equal to rounding)
    a, b = (torch.nn.Parameter(torch.linspace(-1, 1, N, dtype=torch.float64)) for _ in range(2))
    opt = Birder([a], lr=LR, weight_decay=0.1, seed=9, amsgrad=amsgrad, lazy=lazy)
    ref = BirderReference([b], lr=LR, weight_decay=0.1, seed=9, amsgrad=amsgrad, lazy=lazy)
    for t in range(T):
        a.grad, b.grad = _grad(0, t).double(), _grad(0, t).double()
        opt.step()
        ref.step()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    moved = (a.detach()[:STALE] - b.detach().new_tensor([-1.0, -13 / 15, -11 / 15, -9 / 15]) * (1 - LR * 0.1) ** T)
    assert (moved.abs().max() <= BOUND) == lazy  # weight decay aside: at most K lr with lazy, T lr without


def test_lazy_changes_no_bit_of_coordinates_with_gradient_and_no_state():
    # lazy only zeroes u where g = 0: m and b are the paper's, and every coordinate with a gradient gets the same bits
    xs, opts = {}, {}
    for lazy in (True, False):
        xs[lazy] = torch.nn.Parameter(torch.linspace(-1, 1, N))
        opts[lazy] = Birder([xs[lazy]], lr=LR, seed=4, lazy=lazy)
    for t in range(T):
        for lazy in (True, False):
            xs[lazy].grad = _grad(0, t)
            opts[lazy].step()
        sa, sb = opts[True].state[xs[True]], opts[False].state[xs[False]]
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_abs"], sb["exp_avg_abs"])
        assert torch.equal(xs[True].detach()[STALE:], xs[False].detach()[STALE:]), t  # gradient on every step


def test_bad_lazy_is_refused():
    with pytest.raises(ValueError, match="lazy"):
        Birder([torch.nn.Parameter(torch.zeros(2))], lazy="yes")


# --------------------------------------------------------------------------------------------- several ranks
# (layout, method, inter_method, whether the method can express d = 0)
CASES_2 = [(None, "allgather", "allgather", True), (None, "scatter_gather", "allgather", False)]
CASES_4 = [
    ((2, 2), "hierarchical", "allgather", True),
    ((2, 2), "hierarchical", "scatter_gather", False),
    (None, "allgather", "allgather", True),
    (None, "scatter_gather", "allgather", False),
]


def _topology(layout):
    return Topology.flat() if layout is None else Topology.from_layout(*layout)


def _ddp_hook(rank, world, cases):
    out = []
    for layout, method, inter_method, _ in cases:
        topo = _topology(layout)
        for lazy in (True, False):
            model = DDP(_Linear())
            x0 = model.module.w.detach().clone()
            opt = Birder(model.parameters(), lr=LR, seed=11, lazy=lazy)
            attach_ddp_hook(model, opt, topology=topo, method=method, inter_method=inter_method)
            for t in range(T):
                model(_grad(rank, t)).backward()
                opt.step()
                opt.zero_grad()
            out.append((lazy, _moves(x0, model.module.w), model.module.w.detach().clone()))
    return out


def _step_all_reduce(rank, world, cases):
    out = []
    for layout, method, inter_method, _ in cases:
        for lazy in (True, False):
            x = torch.nn.Parameter(torch.linspace(-1, 1, N))
            x0 = x.detach().clone()
            opt = Birder([x], lr=LR, seed=12, lazy=lazy, topology=_topology(layout), method=method)
            for t in range(T):
                x.grad = _grad(rank, t)
                opt.step()
            out.append((lazy, _moves(x0, x), x.detach().clone()))
    return out


def _check(results, cases):
    for i, (_, method, inter_method, exact) in enumerate(cases):
        # the coordinates with a gradient on every rank and step get the same bits with lazy on and off
        assert torch.equal(results[0][2 * i][2][STALE:], results[0][2 * i + 1][2][STALE:]), (method, inter_method)
        for j, lazy in enumerate((True, False)):
            per_rank = [res[2 * i + j] for res in results]
            assert all(torch.equal(r[2], per_rank[0][2]) for r in per_rank), "replicas differ"
            moves = per_rank[0][1]
            case = (method, inter_method, lazy, moves)
            if lazy:
                assert max(moves) <= (BOUND if exact else WALK_BOUND), case
            else:  # the literal update: every rank's u keeps its last sign, so d = that sign, lr per step
                assert min(moves) >= 0.9 * T * LR, case


def test_ddp_hook_two_ranks():
    _check(run_distributed(_ddp_hook, 2, CASES_2), CASES_2)


def test_ddp_hook_four_ranks_hierarchical_and_flat():
    _check(run_distributed(_ddp_hook, 4, CASES_4), CASES_4)


def test_optimizer_side_all_reduce_every_method():
    cases = [((2, 2), "hierarchical", "allgather", True)] + CASES_4[2:]
    _check(run_distributed(_step_all_reduce, 4, cases), cases)


# ------------------------------------------------------------------------------------------------------- HSDP
def _hsdp(rank, world, method, in_backward):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from birder_hf.fsdp import register_birder_fsdp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = []
    for lazy in (True, False):
        model = _Linear()
        fully_shard(model, mesh=mesh["shard"])
        x0 = model.w.full_tensor().detach().clone()
        opt = Birder(model.parameters(), lr=LR, seed=13, lazy=lazy)
        register_birder_fsdp(model, opt, mesh, method=method, in_backward=in_backward)
        for t in range(T):
            model(_grad(rank, t)).backward()
            opt.step()
            opt.zero_grad()
        full = model.w.full_tensor().detach().clone()
        out.append((lazy, _moves(x0, full), full))
    return out


@pytest.mark.parametrize("in_backward", [True, False])
def test_hsdp(in_backward):
    # 2 nodes x 2 ranks: the stale coordinates' node-averaged gradient is 0, u = 0 on both nodes, d = 0
    cases = [(None, "hierarchical", "allgather", True)]
    _check(run_distributed(_hsdp, 4, "hierarchical", in_backward), cases)


def test_state_dict_from_before_the_option_loads_with_the_constructors_lazy():
    # a checkpoint saved before ``lazy`` existed has no such key: it takes the constructor's value (torch.optim's
    # convention for a newer setting); a saved value wins over the constructor's, as for every setting
    x = torch.nn.Parameter(torch.zeros(N))
    opt = Birder([x], lr=LR, seed=1, lazy=True)
    x.grad = _grad(0, 0)
    opt.step()
    saved = opt.state_dict()
    old = {**saved, "param_groups": [{k: v for k, v in g.items() if k != "lazy"} for g in saved["param_groups"]]}
    for lazy in (True, False):
        y = torch.nn.Parameter(torch.zeros(N))
        fresh = Birder([y], lr=LR, lazy=lazy)
        fresh.load_state_dict(old)
        assert fresh.param_groups[0]["lazy"] is lazy
        fresh.load_state_dict(saved)
        assert fresh.param_groups[0]["lazy"] is True
