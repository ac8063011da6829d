"""The one-process simulation of n Birder workers (``benchmarks/simulate_workers.py``) is a real run's arithmetic:
2 x 2 simulated workers give the parameters of 4 real ranks (DDP + the hook, ``hierarchical``) bit for bit."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from _dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from birder_hf import Birder, Topology, attach_ddp_hook

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "simulate_workers.py"
_spec = importlib.util.spec_from_file_location("birder_benchmarks_simulate_workers", _PATH)
sim = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sim
_spec.loader.exec_module(sim)

STEPS = 6
KW = dict(lr=0.01, beta=0.9, weight_decay=0.01, seed=21)


def _model():
    torch.manual_seed(0)
    # an embedding: rows absent from a rank's batch have a zero gradient there (the stale modes' case), and
    # 37 + 8 * 3 + 1 elements leave padding in the last byte of a shard
    return torch.nn.Sequential(torch.nn.Embedding(37, 3), torch.nn.Flatten(), torch.nn.Linear(12, 2))


def _loss(model, rank, step):
    g = torch.Generator().manual_seed(97 * rank + step)
    tokens = torch.randint(0, 37, (5, 4), generator=g)
    return (model(tokens) - torch.randn(5, 2, generator=g)).pow(2).mean()


def _real(rank, world, stale):
    model = DDP(_model())
    opt = Birder(model.parameters(), stale=stale, **KW)
    attach_ddp_hook(model, opt, topology=Topology.from_layout(2, 2), method="hierarchical")
    for t in range(STEPS):
        _loss(model, rank, t).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.module.parameters()]


def _simulated(nodes, local, stale):
    model = _model()
    params = list(model.parameters())
    workers = sim.SimulatedWorkers(params, nodes, local, stale=stale, **KW)
    for t in range(STEPS):
        grads = []
        for r in range(nodes * local):
            model.zero_grad(set_to_none=True)
            _loss(model, r, t).backward()
            grads.append([p.grad.clone() for p in params])
        workers.step(grads)
    return [p.detach().clone() for p in params], workers


@pytest.mark.parametrize("stale", ["fade", "lazy", "keep"])
def test_four_simulated_workers_are_a_real_four_rank_run_bit_for_bit(stale):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank runs
    try:
        simulated, _ = _simulated(2, 2, stale)
    finally:
        torch.set_num_threads(threads)
    real = run_distributed(_real, 4, stale)
    assert all(torch.equal(a, b) for a, b in zip(real[0], real[3]))
    for a, b in zip(simulated, real[0], strict=True):
        assert torch.equal(a, b)
    untouched = _model()
    assert not all(torch.equal(a, b) for a, b in zip(simulated, untouched.parameters()))


def test_more_workers_run_and_keep_the_vote_mean_on_its_grid():
    # 4 nodes x 8: d is a mean of 4 node bits, so a multiple of 1/2 in [-1, 1]
    model = _model()
    params = list(model.parameters())
    workers = sim.SimulatedWorkers(params, 4, 8, **KW)
    grads = []
    for r in range(32):
        model.zero_grad(set_to_none=True)
        _loss(model, r, 0).backward()
        grads.append([p.grad.clone() for p in params])
    d = workers.step(grads)
    assert set((d * 4).tolist()) <= {-4.0, -2.0, 0.0, 2.0, 4.0}
    with pytest.raises(ValueError, match="2 nodes"):
        sim.hierarchical_mean([d], None, 1, 1)
