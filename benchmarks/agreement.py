"""What the cross-rank agreement check of ``onebit_all_reduce`` costs: once per new signature, then a lookup.

    python benchmarks/agreement.py --numel 1000000 --calls 200 --out docs/results/agreement.json

Two forked ranks on gloo over loopback, one thread each. Measured on every rank, reported for rank 0:

- ``extra_collectives``: the all-gathers of int64 signatures that ``onebit_all_reduce`` launched on the first call and
  on the later calls with the same arguments (the check's only collective);
- ``check_exchange_ms``: one signature exchange on its own (what the first call pays on top);
- ``cache_lookup_us``: what every later call pays instead: build its signature and find it in the cache (the
  median of 7 runs of 100,000);
- ``call_ms``: the median time of a whole later call, for scale.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from birder_hf import Topology, collectives, onebit_all_reduce

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402


def _rank(rank: int, world: int, init: str, numel: int, calls: int, lookups: int, queue) -> None:
    os.environ.update({"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        topo = Topology.flat()
        u = torch.rand(numel) * 2 - 1
        gathers = []
        real = collectives._all_gather

        def counting(out, inp, **kwargs):  # the check's all-gather is the only one of int64
            gathers.append(inp.dtype == torch.int64)
            return real(out, inp, **kwargs)

        collectives._all_gather = counting
        onebit_all_reduce(u, topology=topo, method="allgather", keys=1)
        first = sum(gathers)
        gathers.clear()
        times = []
        for i in range(calls):
            t0 = time.perf_counter()
            onebit_all_reduce(u, topology=topo, method="allgather", keys=i)
            times.append(time.perf_counter() - t0)
        later = sum(gathers)
        collectives._all_gather = real

        signature = collectives.signature_of(topo, numel, "allgather", "allgather", 0, u.dtype)
        exchanges = []
        for _ in range(20):
            dist.barrier(group=topo.world_group)
            t0 = time.perf_counter()
            collectives.check_signature(topo, signature, u.device)
            exchanges.append(time.perf_counter() - t0)
        per_lookup = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(lookups):  # what a later call adds: build its signature, find it
                again = collectives.signature_of(topo, numel, "allgather", "allgather", 0, u.dtype)
                collectives.needs_check(topo, again)
            per_lookup.append((time.perf_counter() - t0) / lookups)
        queue.put(
            (
                rank,
                {
                    "extra_collectives": {"first_call": first, "later_calls": later, "later_call_count": calls},
                    "check_exchange_ms": round(statistics.median(exchanges) * 1e3, 3),
                    "cache_lookup_us": round(statistics.median(per_lookup) * 1e6, 3),
                    "call_ms": round(statistics.median(times) * 1e3, 3),
                },
            )
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(numel: int, calls: int, lookups: int = 100_000) -> dict:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, 2, init, numel, calls, lookups, queue)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return {
        "world_size": 2,
        "backend": "gloo (loopback)",
        "numel": numel,
        **results[0],
        "torch": torch.__version__,
        "machine": platform.machine(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1_000_000)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    result = {**run(args.numel, args.calls), **provenance(__file__, argv)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
