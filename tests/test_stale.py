"""A coordinate that stops receiving gradient stops moving (DESIGN.md invariant 7; issue 25), on every path.

m and b decay by the same beta when g = 0, so the paper's u = m / b keeps its last value: a coordinate that saw a
gradient and then only zeros moves by lr every step, in its last direction, without end (``stale="keep"``).
``stale="lazy"`` takes u = 0 where this step's gradient is exactly 0: such a coordinate does not vote.
``stale="fade"`` (the default) decays its m once more per such step, so u shrinks by beta, and takes u = 0 once
|u| < STALE_VOTE_MIN: it votes on at most FADE = ceil(ln(STALE_VOTE_MIN) / ln(beta)) stale steps (59 at beta 0.95).
The methods that can express 0 (one process; ``allgather`` with an even world size; ``hierarchical`` with
``inter_method="allgather"`` and even or unit node counts and sizes) then give it d = 0.

**The bounds checked here**: with weight decay 0, a coordinate whose gradient is exactly 0 on every rank after its
first ``K`` steps moves by at most ``K * lr`` in total with ``lazy`` and ``(K + FADE) * lr`` with ``fade``, however
many steps follow (here ``K = 2``, T = 90 steps in all). ``keep`` (the paper's literal update) moves it by lr per
step: 90 lr here. Methods whose result is one +-1 bit (``scatter_gather``, ``inter_method="scatter_gather"``) cannot
say 0: there such a coordinate random-walks by +-lr per step once it stops voting (no drift: mean 0); the test bounds
it by the mode's bound plus ``4 lr sqrt(T)`` (4 standard deviations).
"""

import math

import pytest
import torch
from _dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from birder_hf import Birder, Topology, attach_ddp_hook
from birder_hf.optim import STALE_VOTE_MIN
from birder_hf.reference import BirderReference

N, STALE, K, T, LR = 16, 4, 2, 90, 0.01  # 16 coordinates, the first 4 get a gradient on the first K of T steps only
FADE = math.ceil(math.log(STALE_VOTE_MIN) / math.log(0.95))  # 59: the stale steps on which "fade" may still vote
BOUND = {"lazy": K * LR * (1 + 1e-5), "fade": (K + FADE) * LR * (1 + 1e-5)}  # float32 rounding of x - lr * d
WALK = 4 * LR * math.sqrt(T)  # one +-1 bit: a fair coin per step once the coordinate stops voting
MODES = ("lazy", "fade", "keep")


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
def test_one_process_stale_coordinate_moves_at_most_its_bound(amsgrad, foreach):
    moved, last = {}, {}
    for stale in MODES:
        x = torch.nn.Parameter(torch.linspace(-1, 1, N))
        x0 = x.detach().clone()
        opt = Birder([x], lr=LR, seed=3, amsgrad=amsgrad, stale=stale, foreach=foreach)
        for t in range(T):
            x.grad = _grad(0, t)
            opt.step()
            if t == K + FADE - 1:
                last[stale] = x.detach()[:STALE].clone()
        moved[stale] = _moves(x0, x)
        if stale != "keep":  # stopped for good: not a coordinate moved after its last possible vote
            assert torch.equal(last[stale], x.detach()[:STALE]), stale
    assert max(moved["lazy"]) <= BOUND["lazy"], moved["lazy"]
    assert max(moved["fade"]) <= BOUND["fade"], moved["fade"]
    if not amsgrad:  # the paper's literal update: lr every step, in the last direction
        assert min(moved["keep"]) >= 0.9 * T * LR, moved["keep"]


def test_issue_example_literal_drifts_200_lr_fade_and_lazy_stop():
    # the issue's numbers: gradient (1, -1, 0.5, 0) at step 0 and zeros after, lr 1e-3, 200 steps
    out = {}
    for stale in MODES:
        p = torch.nn.Parameter(torch.zeros(4))
        opt = Birder([p], lr=1e-3, seed=0, stale=stale)
        for t in range(200):
            p.grad = torch.tensor([1.0, -1.0, 0.5, 0.0]) if t == 0 else torch.zeros(4)
            opt.step()
        out[stale] = p.detach()
    torch.testing.assert_close(out["keep"], torch.tensor([-0.2, 0.2, -0.2, 0.0]), atol=1e-5, rtol=0)
    assert out["lazy"].abs().max().item() <= 1e-3 * (1 + 1e-5) and out["lazy"][3] == 0
    assert out["fade"].abs().max().item() <= (1 + FADE) * 1e-3 * (1 + 1e-5) and out["fade"][3] == 0


def test_fade_keeps_moving_a_coordinate_whose_gradient_is_intermittent():
    # what lazy costs and fade keeps: a gradient of the same sign every 10th step (a rare token's embedding row).
    # keep moves it lr per step (200 lr, and drifts on when it stops); fade votes for ~20 steps per gradient,
    # so it moves it most of that way; lazy moves it on the gradient's steps only (20 lr)
    moved = {}
    for stale in MODES:
        p = torch.nn.Parameter(torch.zeros(1))
        opt = Birder([p], lr=1e-3, seed=5, stale=stale)
        for t in range(200):
            p.grad = torch.ones(1) if t % 10 == 0 else torch.zeros(1)
            opt.step()
        moved[stale] = -p.item() / 1e-3
    assert moved["keep"] == pytest.approx(200, abs=0.01)
    assert moved["lazy"] == pytest.approx(20, abs=0.01)
    assert 120 <= moved["fade"] <= 200, moved


@pytest.mark.parametrize("stale", MODES)
@pytest.mark.parametrize("amsgrad", [False, True])
def test_reference_agrees_with_zero_gradients(stale, amsgrad):
    # BirderReference (paper-literal arithmetic, one line per rule) takes the same option, bit for bit
    # (float64: the two write x - lr (d + wd x) in different orders, equal to rounding)
    a, b = (torch.nn.Parameter(torch.linspace(-1, 1, N, dtype=torch.float64)) for _ in range(2))
    opt = Birder([a], lr=LR, weight_decay=0.1, seed=9, amsgrad=amsgrad, stale=stale)
    ref = BirderReference([b], lr=LR, weight_decay=0.1, seed=9, amsgrad=amsgrad, stale=stale)
    for t in range(T):
        a.grad, b.grad = _grad(0, t).double(), _grad(0, t).double()
        opt.step()
        ref.step()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    moved = (a.detach()[:STALE] - b.detach().new_tensor([-1.0, -13 / 15, -11 / 15, -9 / 15]) * (1 - LR * 0.1) ** T)
    assert (moved.abs().max() <= BOUND.get(stale, 0)) == (stale != "keep")  # weight decay aside


@pytest.mark.parametrize("stale", ["lazy", "fade"])
def test_stale_modes_change_no_bit_of_coordinates_with_gradient_and_lazy_no_state(stale):
    # lazy only zeroes u where g = 0 (m and b are the paper's); fade also decays m there; either way every
    # coordinate with a gradient on every step gets the same state and bits as the paper's update
    xs, opts = {}, {}
    for mode in (stale, "keep"):
        xs[mode] = torch.nn.Parameter(torch.linspace(-1, 1, N))
        opts[mode] = Birder([xs[mode]], lr=LR, seed=4, stale=mode)
    for t in range(T):
        for mode in (stale, "keep"):
            xs[mode].grad = _grad(0, t)
            opts[mode].step()
        sa, sb = opts[stale].state[xs[stale]], opts["keep"].state[xs["keep"]]
        assert torch.equal(sa["exp_avg_abs"], sb["exp_avg_abs"])
        assert torch.equal(sa["exp_avg"][STALE:], sb["exp_avg"][STALE:])
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) or stale == "fade"
        assert torch.equal(xs[stale].detach()[STALE:], xs["keep"].detach()[STALE:]), t  # gradient on every step


def test_bad_stale_is_refused_and_lazy_names_its_replacement():
    with pytest.raises(ValueError, match="stale"):
        Birder([torch.nn.Parameter(torch.zeros(2))], stale="yes")
    with pytest.raises(ValueError, match="stale"):
        Birder([{"params": [torch.nn.Parameter(torch.zeros(2))], "lazy": True}])
    # lazy= (the option's first name, never released) is an unknown setting that says what replaced it
    with pytest.raises(TypeError, match='lazy=True.*stale="lazy"'):
        Birder([torch.nn.Parameter(torch.zeros(2))], lazy=True)
    with pytest.raises(TypeError, match="comm_method.*method="):
        Birder([torch.nn.Parameter(torch.zeros(2))], comm_method="allgather")


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
        for stale in MODES:
            model = DDP(_Linear())
            x0 = model.module.w.detach().clone()
            opt = Birder(model.parameters(), lr=LR, seed=11, stale=stale)
            attach_ddp_hook(model, opt, topology=topo, method=method, inter_method=inter_method)
            for t in range(T):
                model(_grad(rank, t)).backward()
                opt.step()
                opt.zero_grad()
            out.append((stale, _moves(x0, model.module.w), model.module.w.detach().clone()))
    return out


def _step_all_reduce(rank, world, cases):
    out = []
    for layout, method, _inter_method, _ in cases:  # Birder's own all-reduce takes the default inter_method
        for stale in MODES:
            x = torch.nn.Parameter(torch.linspace(-1, 1, N))
            x0 = x.detach().clone()
            opt = Birder([x], lr=LR, seed=12, stale=stale, topology=_topology(layout), method=method)
            for t in range(T):
                x.grad = _grad(rank, t)
                opt.step()
            out.append((stale, _moves(x0, x), x.detach().clone()))
    return out


def _check(results, cases):
    for i, (_, method, inter_method, exact) in enumerate(cases):
        runs = {mode: [res[len(MODES) * i + j] for res in results] for j, mode in enumerate(MODES)}
        for stale, per_rank in runs.items():
            # the coordinates with a gradient on every rank and step get the same bits in every mode
            assert torch.equal(per_rank[0][2][STALE:], runs["keep"][0][2][STALE:]), (method, inter_method, stale)
            assert all(torch.equal(r[2], per_rank[0][2]) for r in per_rank), "replicas differ"
            moves = per_rank[0][1]
            case = (method, inter_method, stale, moves)
            if stale == "keep":  # the literal update: every rank's u keeps its last sign, so d = that sign
                assert min(moves) >= 0.9 * T * LR, case
            else:
                assert max(moves) <= BOUND[stale] + (0 if exact else WALK), case


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
    for stale in MODES:
        model = _Linear()
        fully_shard(model, mesh=mesh["shard"])
        x0 = model.w.full_tensor().detach().clone()
        opt = Birder(model.parameters(), lr=LR, seed=13, stale=stale)
        register_birder_fsdp(model, opt, mesh, method=method, in_backward=in_backward)
        for t in range(T):
            model(_grad(rank, t)).backward()
            opt.step()
            opt.zero_grad()
        full = model.w.full_tensor().detach().clone()
        out.append((stale, _moves(x0, full), full))
    return out


@pytest.mark.parametrize("in_backward", [True, False])
def test_hsdp(in_backward):
    # 2 nodes x 2 ranks: the stale coordinates' node-averaged gradient is 0, u = 0 on both nodes, d = 0
    cases = [(None, "hierarchical", "allgather", True)]
    _check(run_distributed(_hsdp, 4, "hierarchical", in_backward), cases)


def test_state_dict_from_before_the_option_loads_with_the_constructors_stale():
    # a checkpoint saved before ``stale`` existed has no such key: it takes the constructor's value (torch.optim's
    # convention for a newer setting), or the mode its ``lazy`` key named; a saved value wins over the constructor's
    x = torch.nn.Parameter(torch.zeros(N))
    opt = Birder([x], lr=LR, seed=1, stale="lazy")
    x.grad = _grad(0, 0)
    opt.step()
    saved = opt.state_dict()
    strip = {k: v for k, v in saved["param_groups"][0].items() if k != "stale"}
    older = {**saved, "param_groups": [strip]}
    with_lazy = {**saved, "param_groups": [{**strip, "lazy": False}]}
    for stale in MODES:
        y = torch.nn.Parameter(torch.zeros(N))
        fresh = Birder([y], lr=LR, stale=stale)
        fresh.load_state_dict(older)
        assert fresh.param_groups[0]["stale"] == stale
        fresh.load_state_dict(with_lazy)
        assert fresh.param_groups[0]["stale"] == "keep" and "lazy" not in fresh.param_groups[0]
        fresh.load_state_dict(saved)
        assert fresh.param_groups[0]["stale"] == "lazy"
