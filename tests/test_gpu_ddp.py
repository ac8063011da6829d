"""DDP + ``birder_hook`` on CUDA: NCCL with one rank (one GPU) or one rank per GPU, and gloo with several ranks on
one GPU (``"cpu:gloo,cuda:gloo"``: NCCL refuses two ranks on one device, gloo copies CUDA tensors through the host).

Each rank trains a small conv + MLP model (channels_last conv weights, lengths not divisible by 8, several buckets)
through DDP with the hook, and the same model without DDP with ``Birder(topology=...)``, whose 1-bit all-reduce runs
in ``step()`` on the unbucketed gradients: the two must agree bit for bit (parameters, ``m``, ``b``), and replicas
must be identical. On CUDA the last step also counts host synchronisations (none in backward, where the hook runs;
at most one, the documented finite flag, in ``step()``), trains a copy on a side stream, and consumes an async
``onebit_all_reduce`` from another stream.
"""

import pytest
import torch
from _cuda import (
    GLOO_CUDA,
    HAS_CUDA,
    N_CUDA,
    delay_stream,
    gpu,
    host_syncs,
    multi_gpu,
)
from _dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from birder_hf import Birder, BirderHookState, Topology, birder_hook, onebit_all_reduce
from birder_hf.quantize import set_codec_compile

STEPS = 6
_SPAWN = dict(start_method="spawn", timeout=150)


def _model(dtype, device):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, 3),
        torch.nn.Tanh(),
        torch.nn.Conv2d(6, 4, 3),
        torch.nn.Flatten(),
        torch.nn.Linear(64, 1100),  # a bucket of its own above 2^16 elements
        torch.nn.Tanh(),
        torch.nn.Linear(1100, 1),
    )
    return net.to(device=device, dtype=dtype, memory_format=torch.channels_last)


def _batch(rank, step, dtype, device):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 3, 8, 8, generator=g)
    y = x.mean(dim=(1, 2, 3)).unsqueeze(1) + 0.1 * torch.randn(8, 1, generator=g)
    return x.to(device, dtype).contiguous(memory_format=torch.channels_last), y.to(device, dtype)


def _topology(world, method):
    return Topology.from_layout(2, world // 2) if method == "hierarchical" and world >= 4 else Topology.flat()


def _ddp(model, device, method, world):
    ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, bucket_cap_mb=0.001)
    opt = Birder(model.parameters(), lr=0.02, beta=0.9, weight_decay=0.01, seed=5, foreach=False)
    ddp.register_comm_hook(BirderHookState(opt, topology=_topology(world, method), method=method), birder_hook)
    return ddp, opt


def _step(ddp, opt, rank, t, dtype, device):
    x, y = _batch(rank, t, dtype, device)
    (ddp(x) - y).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def async_on_another_stream(device, topo) -> bool:
    """Consume an async onebit_all_reduce's Future on a second stream while the first is still busy."""
    u = (torch.rand(1 << 18, generator=torch.Generator().manual_seed(3)) * 2 - 1).to(device)
    expected = onebit_all_reduce(u, keys=11, topology=topo)
    torch.full_like(u, float("nan"))  # freed at once: the result's allocation likely reuses this block
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)
    delay_stream(30)
    fut = onebit_all_reduce(u, keys=11, topology=topo, async_op=True)
    with torch.cuda.stream(side):
        seen = fut.wait().clone()
    torch.cuda.synchronize(device)
    return torch.equal(seen, expected)


def ddp_rank(rank, world, device, method="allgather", dtype="float32", checks=False):
    """One rank: hook vs unbucketed reference, plus (CUDA, ``checks``) syncs, side stream and async Future.

    ``device``: ``"cuda"`` (GPU ``rank``), ``"cuda:0"`` (every rank on one GPU) or ``"cpu"``.
    """
    dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if dev.type == "cpu":
        set_codec_compile(False)  # CI's CPU check: eager kernels, no compile time
    dt = getattr(torch, dtype)
    hooked, ref = _model(dt, dev), _model(dt, dev)
    ddp, opt = _ddp(hooked, dev, method, world)
    ref_opt = Birder(
        ref.parameters(),
        topology=_topology(world, method),
        method=method,
        lr=0.02,
        beta=0.9,
        weight_decay=0.01,
        seed=5,
        foreach=False,
    )
    out = {}
    for t in range(STEPS):
        x, y = _batch(rank, t, dt, dev)
        loss = (ddp(x) - y).pow(2).mean()
        if checks and dev.type == "cuda" and t == STEPS - 1:  # warm by now: state, buckets rebuilt, kernels built
            out["backward"] = host_syncs(loss.backward)
            out["step"] = host_syncs(opt.step)
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        (ref(x) - y).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    out.update(
        params=[p.detach().cpu() for p in hooked.parameters()],
        ref_params=[p.detach().cpu() for p in ref.parameters()],
        exp_avg=[opt.state[p]["exp_avg"].cpu() for p in hooked.parameters()],
        ref_exp_avg=[ref_opt.state[p]["exp_avg"].cpu() for p in ref.parameters()],
        exp_avg_abs=[opt.state[p]["exp_avg_abs"].cpu() for p in hooked.parameters()],
        ref_exp_avg_abs=[ref_opt.state[p]["exp_avg_abs"].cpu() for p in ref.parameters()],
        state_dtypes=sorted({str(opt.state[p]["exp_avg"].dtype) for p in hooked.parameters()}),
        channels_last=any(p.dim() == 4 and not p.is_contiguous() for p in hooked.parameters()),
    )
    if checks and dev.type == "cuda":
        # the same training on a side stream: the hook's kernels and DDP's copies follow the caller's stream
        side_model = _model(dt, dev)
        side_ddp, side_opt = _ddp(side_model, dev, method, world)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for t in range(STEPS):
                _step(side_ddp, side_opt, rank, t, dt, dev)
        torch.cuda.current_stream(dev).wait_stream(side)
        out["side_stream_params"] = [p.detach().cpu() for p in side_model.parameters()]
        out["async_on_another_stream"] = async_on_another_stream(dev, Topology.flat())
    return out


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def check_ddp_results(results):
    """Replicas identical; every rank's hook run equals its unbucketed reference, bit for bit."""
    for r, res in enumerate(results):
        assert res["channels_last"]
        assert _equal(res["params"], res["ref_params"]), f"rank {r}: parameters differ from the reference"
        assert _equal(res["exp_avg"], res["ref_exp_avg"]) and _equal(res["exp_avg_abs"], res["ref_exp_avg_abs"])
        assert res["state_dtypes"] == ["torch.float32"]
        assert _equal(res["params"], results[0]["params"]), f"rank {r} is not a replica of rank 0"


@pytest.fixture(scope="module")
def nccl_one_rank():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    fp32 = run_distributed(ddp_rank, 1, "cuda", "allgather", "float32", True, backend="nccl", **_SPAWN)
    return fp32[0]


@gpu
def test_ddp_nccl_one_rank_equals_the_unbucketed_optimizer(nccl_one_rank):
    check_ddp_results([nccl_one_rank])


@gpu
def test_hook_makes_no_host_sync(nccl_one_rank):
    backward, step = nccl_one_rank["backward"], nccl_one_rank["step"]
    assert backward["runtime_calls"] > 0, "the profiler saw no CUDA runtime call; it cannot count synchronisations"
    assert backward["syncs"] == [] and backward["sync_warnings"] == [], backward
    assert len(step["syncs"]) <= 1, step  # the finite flag all ranks agree on


@gpu
def test_training_on_a_side_stream_gives_the_same_result(nccl_one_rank):
    assert _equal(nccl_one_rank["side_stream_params"], nccl_one_rank["params"])


@gpu
@pytest.mark.xfail(
    reason="by reading: on a group of one rank the Future is not CUDA-aware (wire.Done), so a consumer on "
    "another stream does not wait for the decode; DDP consumes it on the same stream and is not affected",
    strict=False,
)
def test_async_result_waits_for_its_stream_on_one_rank(nccl_one_rank):
    assert nccl_one_rank["async_on_another_stream"]


@gpu
def test_ddp_nccl_bf16_one_rank():
    check_ddp_results(run_distributed(ddp_rank, 1, "cuda", "scatter_gather", "bfloat16", backend="nccl", **_SPAWN))


@gpu
def test_ddp_gloo_two_ranks_on_one_gpu():
    res = run_distributed(ddp_rank, 2, "cuda:0", "allgather", "float32", backend=GLOO_CUDA, **_SPAWN)
    check_ddp_results(res)
    assert not _equal(res[0]["exp_avg"], res[1]["exp_avg"])  # m is each rank's own


@multi_gpu
@pytest.mark.parametrize("method", ["allgather", "scatter_gather", "hierarchical"])
def test_ddp_nccl_one_rank_per_gpu(method):
    world = min(N_CUDA, 8) // 2 * 2 if method == "hierarchical" else min(N_CUDA, 8)
    if method == "hierarchical" and world < 4:
        pytest.skip("hierarchical needs 4 GPUs (2 simulated nodes of 2)")
    res = run_distributed(ddp_rank, world, "cuda", method, "float32", True, backend="nccl", **_SPAWN)
    check_ddp_results(res)
    for r in res:
        assert r["backward"]["syncs"] == [] and len(r["step"]["syncs"]) <= 1, (r["backward"], r["step"])
        assert _equal(r["side_stream_params"], r["params"]) and r["async_on_another_stream"]


def test_ddp_rank_on_cpu():
    # CI (no GPU): the same rank function on gloo CPU ranks, so the suite's own logic is exercised
    res = run_distributed(ddp_rank, 2, "cpu", "allgather", "float32", True)
    check_ddp_results(res)
    assert "backward" not in res[0]
