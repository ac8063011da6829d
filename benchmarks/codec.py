"""Codec benchmark: 1-bit quantize + pack (and the decode kernels) against a plain copy, one thread.

    python benchmarks/codec.py --numel 25000000 --repeats 7 --out docs/results/codec.json
    python benchmarks/codec.py --small --out docs/results/codec_small.json   # per call, compiled vs eager

Each kernel is timed side by side with ``copy_`` of the same fp32 tensor in the same run (the machine is
shared and noisy, so only the ratios are meaningful); the median over repeats is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from birder_hf import quantize as Q

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402


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


SMALL_SIZES = (16, 128, 1024, 8192, 65536, 262144)


def small(repeats: int, threads: int, calls: int = 200) -> dict:
    """Microseconds per call of the kernels a bucket runs once per parameter, compiled against eager, at the sizes of
    a model's biases, norms and small matrices: where the compiled kernels take over (``_MIN_COMPILED_NUMEL``)."""
    torch.set_num_threads(threads)
    key = Q.derive_key(0, 1)
    rows_of = {n: torch.randint(0, 256, (2, n // 8), dtype=torch.uint8) for n in SMALL_SIZES}  # 2 votes (a node pair)
    out = {"sizes": list(SMALL_SIZES), "threads": threads, "torch": torch.__version__, "calls": calls,
           "loadavg_1min": os.getloadavg()[0], "us_per_call": {}}  # fmt: skip
    for n in SMALL_SIZES:
        u, rows = torch.rand(n) * 2 - 1, rows_of[n]
        params, params_m = Q._key_params(key, 0, None), Q._key_params(key, 0, None, 2)
        dst = torch.empty(n)
        kernels = {
            "quantize_pack": ("quantize_pack", (u, params, False)),
            "requantize_pack": ("requantize_pack", (rows, params_m, False)),
            "votes_mean": ("votes_mean", (rows, Q._int32_words([2], None), dst)),
        }
        row = {}
        for name, (kernel, args) in kernels.items():
            for mode, fn in (("eager", Q._Codec._EAGER[kernel]), ("compiled", Q._codec.get(kernel))):
                sec = median_seconds(lambda fn=fn, args=args: [fn(*args) for _ in range(calls)], repeats)
                row[f"{name} {mode}"] = round(sec / calls * 1e6, 1)
        out["us_per_call"][str(n)] = row
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=25_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eager", action="store_true", help="time the eager kernels instead of the compiled ones")
    ap.add_argument("--small", action="store_true", help="per-call times at small sizes, compiled and eager")
    ap.add_argument("--out", default="docs/results/codec.json")
    args = ap.parse_args(argv)
    if args.small:
        Q.set_codec_compile(True)
        res = small(args.repeats, args.threads)
        for n, row in res["us_per_call"].items():
            print(f"{n:>8} " + "  ".join(f"{k} {v:.1f} us" for k, v in row.items()))
        _write({**res, **provenance(__file__, argv)}, args.out)
        return res
    res = run(args.numel, args.repeats, args.threads, compile_codec=not args.eager)
    print(f"{'kernel':<24}{'ms':>10}{'x copy':>10}")
    for k in res["ms"]:
        print(f"{k:<24}{res['ms'][k]:>10.2f}{res['ratio_vs_copy'][k]:>10.2f}")
    _write({**res, **provenance(__file__, argv)}, args.out)
    return res


def _write(res: dict, out: str | None) -> None:
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
