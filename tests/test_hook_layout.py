"""The Birder hook on parameters whose memory order is not C-contiguous (channels_last conv weights).

DDP lays a dense parameter out in its bucket in the parameter's own memory order and reads the hook's result back
through views with the parameter's strides, while ``GradBucket.gradients()`` views every segment C-contiguously.
The hook must follow the first; these tests failed (m, b and the conv weights diverged from the one-process
optimizer) while it used ``gradients()``.
"""

import pytest
import torch
from _dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from birder_hf import Birder, BirderHookState, Topology, birder_hook


def _conv_model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 2)
    )
    return net.to(memory_format=torch.channels_last)


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)


def _train(rank, world, method, ddp_kwargs, steps=4):
    hooked, ref = _conv_model(), _conv_model()
    ddp = DDP(hooked, bucket_cap_mb=0.001, **ddp_kwargs)  # several buckets
    opt = Birder(hooked.parameters(), lr=0.05, weight_decay=0.01, seed=3)
    ddp.register_comm_hook(BirderHookState(opt, topology=Topology.flat(), method=method), birder_hook)
    ref_opt = Birder(
        ref.parameters(), lr=0.05, weight_decay=0.01, seed=3, topology=Topology.flat(), comm_method=method
    )
    for t in range(steps):
        x = _batch(rank, t)
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    pairs = list(zip(hooked.parameters(), ref.parameters()))
    return {
        "channels_last": [p.dim() == 4 and not p.is_contiguous() for p, _ in pairs],
        "params": [torch.equal(p, q) for p, q in pairs],
        "exp_avg": [torch.equal(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"]) for p, q in pairs],
        "snapshot": [p.detach().clone() for p, _ in pairs],
    }


@pytest.mark.parametrize(
    "method, ddp_kwargs",
    [("allgather", {}), ("scatter_gather", {"gradient_as_bucket_view": True})],
    ids=["allgather", "scatter_gather-grad_as_bucket_view"],
)
def test_channels_last_hook_equals_the_unbucketed_optimizer(method, ddp_kwargs):
    res = run_distributed(_train, 2, method, ddp_kwargs)
    for r in res:
        assert any(r["channels_last"])  # the model really holds NHWC conv weights
        assert all(r["params"]) and all(r["exp_avg"]), r
    assert all(torch.equal(a, b) for a, b in zip(res[0]["snapshot"], res[1]["snapshot"]))
