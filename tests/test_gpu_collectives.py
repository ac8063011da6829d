"""``onebit_all_reduce`` with CUDA tensors on several ranks: the same ``d`` as with CPU tensors, on every rank.

On one GPU the ranks share the device through gloo (``"cpu:gloo,cuda:gloo"``: gloo's all-gather and all-to-all take
CUDA tensors and move them through pinned host memory; NCCL refuses two ranks on one device). That still runs every
CUDA code path of the collectives: the codec and decode kernels, CUDA-aware Futures from the backend, their
callbacks on the backend's threads and streams. With 2+ GPUs the same runs on NCCL (``multi_gpu``).

World sizes 3 and 4: with 3 ranks (or 3 simulated nodes) vote means divide by 3, which only exact division gets
right bit for bit. The largest case is above ``2^16`` elements.
"""

import pytest
import torch
from _cuda import GLOO_CUDA, N_CUDA, eager_codec, gpu, multi_gpu
from _dist import run_distributed
from test_gpu_ddp import async_on_another_stream

from birder_hf import Topology, onebit_all_reduce

CASES = [(1001, "float32", None), (4099, "bfloat16", 512), (3 * (1 << 16) + 5, "float32", None)]
LAYOUTS = {3: [(1, 3), (3, 1)], 4: [(1, 4), (2, 2)]}  # (num_nodes, local_world_size)
_SPAWN = dict(start_method="spawn", timeout=150)


def _methods(layout):
    if layout[0] == 1:
        return [("allgather", "allgather"), ("scatter_gather", "allgather")]
    return [("hierarchical", "allgather"), ("hierarchical", "scatter_gather")]


def collectives_rank(rank, world, device, cases=CASES):
    """Every method and layout on CPU tensors and on ``device`` tensors (sync and async), same keys."""
    dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    out = {}
    for layout in LAYOUTS[world]:
        topo = Topology.from_layout(*layout)
        for method, inter in _methods(layout):
            for n, dtype, chunk in cases:
                g = torch.Generator().manual_seed(1000 * rank + n)
                u = (torch.rand(n, generator=g) * 2 - 1).to(getattr(torch, dtype))
                kw = dict(topology=topo, method=method, inter_method=inter, chunk_numel=chunk)
                name = f"{layout[0]}x{layout[1]} {method}/{inter} n={n} {dtype} chunk={chunk}"
                with eager_codec():  # the CPU reference: the same bits, no C++ compile on the device
                    d_cpu = onebit_all_reduce(u, keys=n + 7, **kw)
                d_dev = onebit_all_reduce(u.to(dev), keys=n + 7, **kw)
                d_async = onebit_all_reduce(u.to(dev), keys=n + 7, async_op=True, **kw).wait()
                out[name] = (d_cpu, d_dev.cpu(), d_async.cpu())
        if dev.type == "cuda":
            out[f"{layout[0]}x{layout[1]} async Future read on another stream"] = async_on_another_stream(dev, topo)
    return out


def check_collectives_results(results):
    for r, res in enumerate(results):
        for name, value in res.items():
            if isinstance(value, bool):
                assert value, f"rank {r}: {name}"
                continue
            d_cpu, d_dev, d_async = value
            assert d_dev.dtype == d_cpu.dtype and torch.equal(d_dev, d_cpu), f"rank {r}: {name}: device != CPU"
            assert torch.equal(d_async, d_cpu), f"rank {r}: {name}: async != sync"
            assert torch.equal(d_cpu, results[0][name][0]), f"rank {r}: {name}: not a replica of rank 0"
            assert d_cpu.abs().max() <= 1


@gpu
@pytest.mark.parametrize("world", [3, 4])
def test_onebit_all_reduce_cuda_equals_cpu_ranks_on_one_gpu(world):
    check_collectives_results(run_distributed(collectives_rank, world, "cuda:0", backend=GLOO_CUDA, **_SPAWN))


@multi_gpu
def test_onebit_all_reduce_nccl_equals_cpu():
    world = 4 if N_CUDA >= 4 else 3 if N_CUDA >= 3 else None
    if world is None:
        pytest.skip("the layouts need 3 or 4 GPUs")
    res = run_distributed(collectives_rank, world, "cuda", backend="cpu:gloo,cuda:nccl", **_SPAWN)
    check_collectives_results(res)


def test_collectives_rank_on_cpu():
    # CI (no GPU): the same rank function on gloo CPU ranks; small sizes, eager kernels
    res = run_distributed(collectives_rank, 3, "cpu", CASES[:2])
    check_collectives_results(res)
    assert len(res[0]) == 8
