"""Time each 1-bit all-reduce method against DDP's fp32 ``all_reduce``, side by side, on loopback ranks.

    python benchmarks/collectives.py --numel 25000000 --world-size 4 --repeats 7

Forks ``--world-size`` gloo ranks on this host (one thread each). The hierarchical rows simulate
``2 nodes x world/2`` with ``Topology.from_layout``; on one host every link is loopback, so these
numbers show the codec's cost next to the bytes saved, not a real inter-node gain (the network-namespace
testbed of docs/BENCHMARKS.md shapes links for that). Each repetition runs every method once, in turn, after a
barrier; a method's time is that of its slowest rank; the table gives the median over repetitions.
"cpu ms" is the CPU time of all ranks together (``time.process_time``, every thread of each rank) for one
call: on an oversubscribed or shared machine it measures the local compute better than the wall time.
``--reuse-out`` passes a preallocated ``out=`` (on CPU a fresh 4-byte-per-element output costs page faults).
Writes JSON to ``--out`` (default ``docs/results/collectives.json``).
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
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile worker pool per rank

import torch  # noqa: E402
import torch._dynamo  # noqa: E402,F401  (imported before forking: ranks start fast)
import torch.distributed as dist  # noqa: E402

from birder_hf.collectives import (  # noqa: E402
    CommStats,  # noqa: E402
    expected_bytes,
    onebit_all_reduce,
)
from birder_hf.quantize import STAGE_WORKER, BitKeys, antithetic  # noqa: E402
from birder_hf.topology import Topology  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402


def _cases(world: int):
    cases = [("fp32 all_reduce", None, None, None), ("allgather", None, "allgather", "allgather")]
    cases.append(("scatter_gather", None, "scatter_gather", "allgather"))
    if world % 2 == 0 and world >= 4:
        layout = (2, world // 2)
        for inter in ("allgather", "scatter_gather"):
            cases.append((f"hierarchical 2x{world // 2} (inter {inter})", layout, "hierarchical", inter))
    return cases


def _rank(rank, world, init_file, args, q):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        topologies = {None: Topology.flat()}
        for _, layout, _, _ in _cases(world):
            if layout is not None and layout not in topologies:
                topologies[layout] = Topology.from_layout(*layout)
        g = torch.Generator().manual_seed(rank)
        u = torch.rand(args.numel, generator=g).mul_(2).sub_(1)
        buf = torch.empty_like(u)
        out = torch.empty_like(u) if args.reuse_out else None

        def run(case, seed, stats=None):
            name, layout, method, inter = case
            if method is None:
                buf.copy_(u)  # DDP reduces into its bucket: copy included, as in the hook
                dist.all_reduce(buf)
                return
            onebit_all_reduce(
                u,
                topology=topologies[layout],
                method=method,
                inter_method=inter,
                keys=seed,
                chunk_numel=args.chunk_numel,
                stats=stats,
                **({} if out is None else {"out": out}),
            )

        cases = _cases(world)
        # warm-up: compiles the codec kernels (torch.compile, once per process) and opens connections
        stats = {}
        for case in cases:
            st = CommStats()
            run(case, 0, st)
            stats[case[0]] = st
            if rank == 0:
                print(f"  warm-up {case[0]} done", flush=True)
        times = {case[0]: [] for case in cases}
        cpu = {case[0]: [] for case in cases}
        codec = []
        keys = BitKeys.single(1, 0, args.numel)
        for rep in range(args.repeats):
            for case in cases:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                run(case, rep + 1)
                times[case[0]].append(time.perf_counter() - t0)
                cpu[case[0]].append(time.process_time() - c0)
            t0 = time.perf_counter()
            who, reflect = antithetic(rank)  # this rank's draw, as onebit_all_reduce makes it
            keys.quantize_pack(u, 0, STAGE_WORKER, who, reflect=reflect)
            codec.append(time.perf_counter() - t0)
            if rank == 0:
                print(f"  repetition {rep + 1}/{args.repeats} done", flush=True)
        dist.barrier()
        dist.destroy_process_group()
        q.put(
            (
                rank,
                True,
                {"times": times, "cpu": cpu, "codec": codec, "stats": {k: v.as_dict("") for k, v in stats.items()}},
            )
        )
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=25_000_000, help="elements per all-reduce (25M = ResNet-50)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--chunk-numel", type=int, default=None, help="onebit_all_reduce chunk_numel")
    parser.add_argument("--reuse-out", action="store_true", help="write d into a preallocated out= buffer")
    parser.add_argument("--out", default="docs/results/collectives.json")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)

    world = args.world_size
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    print(f"{world} ranks, {args.numel:,} elements, {args.repeats} repetitions", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), args, q)) for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        deadline = time.monotonic() + args.timeout
        try:
            while len(results) < world and time.monotonic() < deadline:
                try:
                    r, ok, value = q.get(timeout=1)
                except Exception:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        break
                    continue
                if not ok:
                    raise RuntimeError(f"rank {r} failed:\n{value}")
                results[r] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    if len(results) < world:
        sys.exit(f"only {len(results)} of {world} ranks finished")

    names = [c[0] for c in _cases(world)]
    layouts = {c[0]: c for c in _cases(world)}
    rows = []
    base = base_cpu = None
    for name in names:
        per_rep = [max(results[r]["times"][name][i] for r in range(world)) for i in range(args.repeats)]
        med = statistics.median(per_rep) * 1e3
        cpu_ms = statistics.median(sum(results[r]["cpu"][name][i] for r in range(world)) for i in range(args.repeats))
        cpu_ms *= 1e3
        base = med if base is None else base
        base_cpu = cpu_ms if base_cpu is None else base_cpu
        st = results[0]["stats"][name]
        _, layout, method, inter = layouts[name]
        row = {"method": name, "median_ms": round(med, 2), "min_ms": round(min(per_rep) * 1e3, 2)}
        row["ratio_vs_all_reduce"] = round(med / base, 3)
        row["cpu_ms_all_ranks"], row["cpu_ratio_vs_all_reduce"] = round(cpu_ms, 2), round(cpu_ms / base_cpu, 3)
        if method is None:
            row["bytes_sent_per_rank"] = round(2 * (world - 1) / world * 4 * args.numel)
        else:
            row["bytes_sent_per_rank"] = st["intra_node_bytes"] + st["inter_node_bytes"]
            row["intra_node_bytes"], row["inter_node_bytes"] = st["intra_node_bytes"], st["inter_node_bytes"]
            row["expected"] = expected_bytes(method, args.numel, layout or (1, world), inter_method=inter)
            row["compression_ratio"] = round(st["compression_ratio"], 2)
        rows.append(row)
    codec_ms = statistics.median(max(results[r]["codec"][i] for r in range(world)) for i in range(args.repeats)) * 1e3

    out = {
        "config": {
            "numel": args.numel,
            "world_size": world,
            "repeats": args.repeats,
            "chunk_numel": args.chunk_numel,
            "reuse_out": args.reuse_out,
            "backend": "gloo (loopback)",
            "threads_per_rank": 1,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
        "rows": rows,
        "codec_quantize_pack_ms": round(codec_ms, 2),
        **provenance(__file__, argv),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)

    head = f"{'method':<40} {'median ms':>10} {'vs all_reduce':>14} {'cpu ms':>8} {'vs':>6}"
    print(f"\n{head} {'bytes/rank':>12} {'inter-node':>12}")
    for row in rows:
        inter = row.get("inter_node_bytes", "")
        print(
            f"{row['method']:<40} {row['median_ms']:>10.1f} {row['ratio_vs_all_reduce']:>13.2f}x "
            f"{row['cpu_ms_all_ranks']:>8.0f} {row['cpu_ratio_vs_all_reduce']:>5.2f}x "
            f"{row['bytes_sent_per_rank']:>12,} {inter if inter == '' else f'{inter:,}':>12}"
        )
    print(f"codec alone (quantize + pack {args.numel:,}, slowest rank): {codec_ms:.1f} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
