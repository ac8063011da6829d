"""The 1-bit hooks on parameters whose memory order is not C-contiguous (channels_last conv weights).

DDP lays a dense parameter out in its bucket in the memory order the parameter had when DDP built its buckets, and
reads the hook's result back through views with those strides, while ``GradBucket.gradients()`` views every segment
C-contiguously. The hooks must follow DDP (``DDPBuckets._grad`` in birder_hf.communicators). These tests failed
while the hooks used ``gradients()``: m, b and the conv weights diverged from the one-process optimizer, a checkpoint
written under the hook resumed scrambled through ``step()``, and 1-bit Adam's compressed momentum mixed up elements.
"""

import pytest
import torch
from _dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from birder_hf import Birder, BirderHookState, OneBitAdam, Topology, attach_ddp_hook, birder_hook
from birder_hf.checkpoint import load_rank_state, save_rank_state

CL = torch.channels_last


def _conv_model(channels_last=True):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3), torch.nn.Flatten(), torch.nn.Linear(64, 2)
    )
    return net.to(memory_format=CL) if channels_last else net


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 3, 8, 8, generator=g).to(memory_format=CL)


def _reference(method="allgather"):
    # the optimizer-side 1-bit all-reduce (no buckets) on the same channels_last model: what the hook must match
    ref = _conv_model()
    opt = Birder(ref.parameters(), lr=0.05, weight_decay=0.01, seed=3, topology=Topology.flat(), method=method)
    return ref, opt


def _step(model, opt, x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _compare(hooked, opt, ref, ref_opt):
    pairs = list(zip(hooked.parameters(), ref.parameters()))
    keys = ("exp_avg", "exp_avg_abs", "step")
    return {
        "channels_last": [p.dim() == 4 and not p.is_contiguous() for p, _ in pairs],
        "params": [torch.equal(p, q) for p, q in pairs],
        "state": [all(torch.equal(opt.state[p][k], ref_opt.state[q][k]) for k in keys) for p, q in pairs],
        "snapshot": [p.detach().clone() for p, _ in pairs],
    }


def _train(rank, world, method, ddp_kwargs, steps=4):
    hooked = _conv_model()
    ddp = DDP(hooked, bucket_cap_mb=0.001, **ddp_kwargs)  # several buckets
    opt = Birder(hooked.parameters(), lr=0.05, weight_decay=0.01, seed=3)
    ddp.register_comm_hook(BirderHookState(opt, topology=Topology.flat(), method=method), birder_hook)
    ref, ref_opt = _reference(method)
    for t in range(steps):
        _step(ddp, opt, _batch(rank, t))
        _step(ref, ref_opt, _batch(rank, t))
    return _compare(hooked, opt, ref, ref_opt)


def _check(res):
    for r in res:
        assert any(r["channels_last"])  # the model really holds NHWC conv weights
        assert all(r["params"]) and all(r["state"]), r
    assert all(torch.equal(a, b) for a, b in zip(res[0]["snapshot"], res[1]["snapshot"]))


@pytest.mark.parametrize(
    "method, ddp_kwargs",
    [("allgather", {}), ("scatter_gather", {"gradient_as_bucket_view": True})],
    ids=["allgather", "scatter_gather-grad_as_bucket_view"],
)
def test_channels_last_hook_equals_the_unbucketed_optimizer(method, ddp_kwargs):
    _check(run_distributed(_train, 2, method, ddp_kwargs))


def _converted_after_wrapping(rank, world, ddp_kwargs, steps=4):
    # DDP built its buckets for contiguous weights; the model becomes channels_last afterwards. DDP keeps the old
    # layout until it rebuilds its buckets after the first step (never with find_unused_parameters=True).
    hooked = _conv_model(channels_last=False)
    ddp = DDP(hooked, bucket_cap_mb=0.001, **ddp_kwargs)
    hooked.to(memory_format=CL)
    opt = Birder(hooked.parameters(), lr=0.05, weight_decay=0.01, seed=3)
    ddp.register_comm_hook(BirderHookState(opt, topology=Topology.flat(), method="allgather"), birder_hook)
    ref, ref_opt = _reference()
    for t in range(steps):
        _step(ddp, opt, _batch(rank, t))
        _step(ref, ref_opt, _batch(rank, t))
    return _compare(hooked, opt, ref, ref_opt)


@pytest.mark.filterwarnings("ignore:Grad strides do not match bucket view strides")
@pytest.mark.parametrize(
    "ddp_kwargs",
    [{}, {"find_unused_parameters": True}, {"gradient_as_bucket_view": True}],
    ids=["rebuilt", "never-rebuilt", "grad_as_bucket_view"],
)
def test_model_converted_to_channels_last_after_ddp_wrapping(ddp_kwargs):
    _check(run_distributed(_converted_after_wrapping, 2, ddp_kwargs))


def _resume_through_step(rank, world, folder, steps=3, more=2):
    # hook mode writes the checkpoint; the optimizer-side all-reduce (step() does it all) resumes from it
    hooked = _conv_model()
    ddp = DDP(hooked, bucket_cap_mb=0.001)
    opt = Birder(hooked.parameters(), lr=0.05, weight_decay=0.01, seed=3)
    ddp.register_comm_hook(BirderHookState(opt, topology=Topology.flat(), method="allgather"), birder_hook)
    for t in range(steps):
        _step(ddp, opt, _batch(rank, t))
    save_rank_state(opt, folder)
    resumed = _conv_model()
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), hooked.parameters()):
            p.copy_(q)
    resumed_opt = Birder(resumed.parameters(), lr=0.05, weight_decay=0.01, seed=3, topology=Topology.flat())
    load_rank_state(resumed_opt, folder)
    for t in range(steps, steps + more):
        _step(ddp, opt, _batch(rank, t))
        _step(resumed, resumed_opt, _batch(rank, t))
    return _compare(hooked, opt, resumed, resumed_opt)


def test_checkpoint_written_under_the_hook_resumes_through_step(tmp_path):
    _check(run_distributed(_resume_through_step, 2, str(tmp_path)))


class _Elementwise(torch.nn.Module):
    """A 4-D weight used only elementwise (through a contiguous copy): its gradient has the same values, bit for bit,
    whatever its memory format, so a channels_last run and a contiguous run must agree bit for bit."""

    def __init__(self, channels_last):
        super().__init__()
        torch.manual_seed(0)
        w = torch.randn(4, 3, 3, 3)
        self.w = torch.nn.Parameter(w.to(memory_format=CL) if channels_last else w)
        self.head = torch.nn.Linear(108, 1)

    def forward(self, x):
        return self.head((x * self.w.contiguous()).flatten(1))


def _onebit_adam_run(rank, world, channels_last, steps=6):
    model = _Elementwise(channels_last)
    ddp = DDP(model)
    opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=2)
    attach_ddp_hook(ddp, opt, topology=Topology.flat())
    for t in range(steps):
        g = torch.Generator().manual_seed(100 * rank + t)
        ddp(torch.randn(2, 4, 3, 3, 3, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {
        "channels_last": not model.w.is_contiguous(),
        "params": [p.detach().clone() for p in model.parameters()],
        "state": [{k: v for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in model.parameters()],
    }


def test_onebit_adam_hook_is_blind_to_the_memory_format():
    nhwc = run_distributed(_onebit_adam_run, 2, True)
    plain = run_distributed(_onebit_adam_run, 2, False)
    for a, b in zip(nhwc, plain):
        assert a["channels_last"] and not b["channels_last"]
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        for sa, sb in zip(a["state"], b["state"]):  # m, v and both error buffers (the compressed phase ran)
            assert "worker_error" in sa and all(torch.equal(sa[k], sb[k]) for k in sa)
