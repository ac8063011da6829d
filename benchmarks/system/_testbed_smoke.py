"""Smoke test for `benchmarks/system/testbed.py`: a gloo all_reduce across emulated nodes, launched by torchrun.

Run by ``python benchmarks/system/testbed.py check`` on every node of a fresh testbed.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=1_000_000, help="fp32 elements in the timed all_reduce")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # exact check: sum of (rank + 1) over ranks
    x = torch.full((8,), float(rank + 1))
    dist.all_reduce(x)
    expected = world * (world + 1) / 2
    if not torch.equal(x, torch.full((8,), expected)):
        raise AssertionError(f"rank {rank}: all_reduce gave {x.tolist()}, expected {expected}")
    # timed all_reduce, so shaped and unshaped links can be told apart
    y = torch.ones(args.numel)
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(y)
    elapsed = time.perf_counter() - t0
    if y[0].item() != world or y[-1].item() != world:
        raise AssertionError(f"rank {rank}: timed all_reduce gave {y[0].item()}, expected {world}")
    print(
        f"smoke ok rank={rank} world_size={world} GROUP_RANK={os.environ.get('GROUP_RANK')} "
        f"LOCAL_RANK={os.environ.get('LOCAL_RANK')} LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')} "
        f"GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME')} allreduce_numel={args.numel} "
        f"allreduce_ms={elapsed * 1e3:.1f}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
