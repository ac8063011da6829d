"""Codec benchmark: 1-bit quantize + pack (and the decode kernels) against a plain copy, one thread.

    python benchmarks/codec.py --numel 25000000 --repeats 7 --out docs/results/codec.json

Each kernel is timed side by side with ``copy_`` of the same fp32 tensor in the same run (the machine is
shared and noisy, so only the ratios are meaningful); the median over repeats is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from birder_hf import quantize as Q


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls, after one warm-up call (which compiles)."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def run(numel: int, repeats: int, threads: int, compile_codec: bool = True) -> dict:
    torch.set_num_threads(threads)
    Q.set_codec_compile(compile_codec)
    u = torch.rand(numel) * 2 - 1
    dst = torch.empty_like(u)
    key = Q.derive_key(0, 1)
    packed = Q.quantize_pack(u, key)
    votes = torch.stack([Q.quantize_pack(u, Q.derive_key(0, r)) for r in range(4)])  # 4 ranks' packed votes
    kernels = {
        "copy_ fp32": lambda: dst.copy_(u),
        "quantize+pack": lambda: Q.quantize_pack(u, key),
        "unpack": lambda: Q.unpack_bits(packed, numel),
        "mean of 4 votes": lambda: Q.votes_mean_(dst, votes),  # allgather's decode, into fp32
        "signs": lambda: Q.votes_mean_(dst, votes[:1]),  # scatter_gather's decode
        "requantize 4 votes": lambda: Q.requantize_pack(votes, key),  # a shard owner's count + draw + pack
        "rand_like < p (naive)": lambda: torch.rand_like(u) < 0.5,
    }
    times = {}
    for name, fn in kernels.items():
        times[name] = median_seconds(fn, repeats)
    # interleave copy timings again so the ratio is not skewed by drift during the run
    times["copy_ fp32"] = min(times["copy_ fp32"], median_seconds(kernels["copy_ fp32"], repeats))
    base = times["copy_ fp32"]
    return {
        "numel": numel,
        "threads": threads,
        "compiled": compile_codec,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "ms": {k: round(v * 1e3, 2) for k, v in times.items()},
        "ratio_vs_copy": {k: round(v / base, 2) for k, v in times.items()},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eager", action="store_true", help="time the eager kernels instead of the compiled ones")
    ap.add_argument("--out", default="docs/results/codec.json")
    args = ap.parse_args(argv)
    res = run(args.numel, args.repeats, args.threads, compile_codec=not args.eager)
    print(f"{'kernel':<24}{'ms':>10}{'x copy':>10}")
    for k in res["ms"]:
        print(f"{k:<24}{res['ms'][k]:>10.2f}{res['ratio_vs_copy'][k]:>10.2f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
