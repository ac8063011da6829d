"""Communication-efficiency benchmark: samples/s of DDP training under fp32, fp16, PowerSGD and Birder, across nodes.

The official code's Ethernet / InfiniBand "system throughput" comparison, on one machine: two emulated nodes
(network namespaces, ``benchmarks/system/testbed.py``) joined by a 150 Mbit/s shaped link (``ethernet``: the
compute/communication balance of 10 GbE between A100 nodes, scaled to these CPU cores) or an unshaped one (``ib``:
bandwidth to spare). Every configuration is one ``torchrun`` job per node running
``benchmarks/system/_throughput_worker.py``, which times every method side by side in the same processes.

    python benchmarks/system/throughput.py      # the full run (~30 min): docs/results/throughput.json + PNGs
    python benchmarks/system/throughput.py --models tiny-bert --batches tiny-bert=4 --profiles ethernet --rounds 1
    python benchmarks/system/throughput.py --local ...     # no namespaces: all ranks on loopback (profile "local")

Batch sizes (samples per process): the seed measured 32 and 128 samples per A100. What has to carry over is the
ratio of compute time to communication time per step. The ethernet link is ~65x slower than 10 GbE (goodput
~9.4 Gbit/s vs the measured 144.8 Mbit/s), and with 2 nodes x 1 process each node sends the same 2(k-1)/k x 4d bytes
per fp32 step as a node of 8 A100s does, so a step's compute must take ~65x as long as on an A100:

    per-process batch = seed batch x t_A100 x 65 / t_cpu          (t: seconds per sample, forward + backward)

with t_A100 = 1/938 s (ResNet-50, NVIDIA DeepLearningExamples, 1x A100 80GB, TF32) and ~1/1085 s (BERT-Base seq 128:
BERT-Large phase-1 TF32 307 seq/s x 3.53 FLOP ratio), and t_cpu measured on one thread (ResNet-50 224^2: 0.45 s,
BERT-Base: 0.85 s). That gives ResNet-50 at 224^2: 32 -> 4.9 and 128 -> 19.8 images, BERT-Base: 32 -> 2.4 and
128 -> 9.8 sequences; we run 4/16 and 2/8 (rounded down, keeping the seed's 1:4). Two ranks share the two cores, and
other jobs load the machine, which makes our steps more compute-bound than that: conservative for the compressors.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent))  # benchmarks/plots.py

import testbed  # noqa: E402
from provenance import provenance  # noqa: E402

WORKER = _HERE / "_throughput_worker.py"
METHODS = (
    "fp32-adamw",
    "fp32-sgdm",
    "fp16",
    "powersgd",
    "birder-allgather",
    "birder-scatter_gather",
    "birder-hierarchical",
    "onebitadam",
)
PRIMARY = {"bert": "fp32-adamw", "tiny-bert": "fp32-adamw", "resnet50": "fp32-sgdm", "tiny-mlp": "fp32-sgdm"}
# model -> (per-process batches, the seed's per-GPU batches they stand for, extra worker args)
CONFIGS = {
    "bert": ([2, 8], [32, 128], ["--seq-len", "128"]),
    "resnet50": ([4, 16], [32, 128], ["--image-size", "224"]),
    "tiny-bert": ([4, 16], [32, 128], ["--seq-len", "32"]),
    "tiny-mlp": ([4, 16], [32, 128], []),
}
LABELS = {
    "fp32-adamw": "DDP fp32 (AdamW)",
    "fp32-sgdm": "DDP fp32 (SGDM)",
    "fp16": "fp16 hook",
    "powersgd": "PowerSGD (rank 4)",
    "birder-allgather": "Birder allgather",
    "birder-scatter_gather": "Birder scatter_gather",
    "birder-hierarchical": "Birder hierarchical",
    "onebitadam": "1-bit Adam",
}
# Birder hierarchical's targets (issue 29): (profile, model, batch or None for every batch) -> (measure, at least);
# with a slow link, a share of the no-communication bound (and, for BERT-Base, a step ahead of PowerSGD's); with a
# fast one, the speed of fp32 DDP
TARGETS = {
    ("ethernet", "bert", 8): ("share_of_bound", 0.95),
    ("ethernet", "resnet50", 16): ("share_of_bound", 0.95),
    ("ib", "bert", None): ("ratio_vs_fp32", 0.95),
    ("ib", "resnet50", None): ("ratio_vs_fp32", 0.95),
}
AHEAD_OF = {("ethernet", "bert", 8): "powersgd"}


# --------------------------------------------------------------------------------------------------------- running
class _Tail(threading.Thread):
    """Prints each record the workers append to the JSON-lines file, while the job runs (progress)."""

    def __init__(self, path: Path, prefix: str, t0: float):
        super().__init__(daemon=True)
        self.path, self.prefix, self.t0 = path, prefix, t0
        self.stop = threading.Event()
        self.seen = 0

    def poll(self) -> None:
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        for line in lines[self.seen :]:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                return  # half-written; read it next time
            self.seen += 1
            if rec.get("kind") == "progress":
                print(
                    f"  [{time.perf_counter() - self.t0:7.0f} s] {self.prefix} b{rec['batch_per_proc']} {rec['msg']}"
                )
            if rec.get("kind") == "method":
                print(
                    f"  [{time.perf_counter() - self.t0:7.0f} s] {self.prefix} b{rec['batch_per_proc']} "
                    f"{rec['method']:<22} "
                    f"{rec['step_s_mean']:7.2f} s/step {rec['samples_per_s']:8.2f} samples/s "
                    f"({rec['timed_steps']} steps)",
                    flush=True,
                )

    def run(self) -> None:
        while not self.stop.wait(2.0):
            self.poll()


def methods_for(args, model: str) -> list[str]:
    """--methods, or by default: fp32 DDP with the model's optimizer in the paper (AdamW for BERT, SGDM for
    ResNet-50), the two torch hooks (same optimizer), the three Birder all-reduces and 1-bit Adam (its compressed
    phase: one warm-up step, in the warm-up round)."""
    if args.methods:
        return list(args.methods)
    # the pair the targets compare runs back to back (the machine's load drifts)
    return [
        PRIMARY[model],
        "birder-hierarchical",
        "fp16",
        "powersgd",
        "birder-allgather",
        "birder-scatter_gather",
        "onebitadam",
    ]


def _worker_args(args, model: str, batches: list[int], tag: dict, out: Path) -> list[str]:
    extra = CONFIGS[model][2]
    methods = methods_for(args, model)
    argv = ["--model", model, "--batch", *map(str, batches), *extra, "--methods", *methods]
    argv += ["--rounds", str(args.rounds), "--tag", json.dumps(tag), "--out", str(out)]
    if args.refs:
        # BERT-Base: no ref-onebitadam, whose second OneBitAdam (m, v and two error buffers: 1.7 GB per rank) took
        # two ranks past this machine's 23 GB; the breakdown then shows its codec inside "comm CPU"
        solo = ("fp16", "powersgd") + (("onebitadam",) if model != "bert" else ())
        refs = ["ref-compute"] + [f"ref-{m}" for m in solo if m in methods]
        refs += ["ref-birder"] if any(m.startswith("birder") for m in methods) else []
        argv += ["--refs", *refs, "--profile-ops"]
    return argv


def _job_env() -> dict[str, str]:
    # one thread per rank (two ranks share the two cores); no compile worker pool per rank; two malloc arenas (the
    # hooks run on autograd and gloo threads, and per-thread arenas kept GBs of freed buffers on a shared machine)
    return {
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "MALLOC_ARENA_MAX": "2",
    }


def _run_job(args, tb, model, batches, tag, out: Path, t0: float) -> None:
    prefix = f"{tag['profile']:<8} {model}"
    tail = _Tail(out, prefix, t0)
    tail.seen = len(out.read_text().splitlines()) if out.exists() else 0
    tail.start()
    try:
        argv = _worker_args(args, model, batches, tag, out)
        if tb is not None:
            runs = tb.launch_torchrun(WORKER, args.nproc_per_node, argv, timeout=args.timeout, env=_job_env())
            logs = [(r.node, r.returncode, r.log) for r in runs]
        else:  # --local: every rank on this host's loopback, no shaping
            nproc = args.nodes * args.nproc_per_node
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
            env = {**os.environ, **_job_env(), "GLOO_SOCKET_IFNAME": "lo"}
            proc = subprocess.run(
                [*cmd, str(WORKER), *argv], env=env, capture_output=True, text=True, timeout=args.timeout
            )
            logs = [(0, proc.returncode, proc.stdout + proc.stderr)]
    finally:
        tail.stop.set()
        tail.join()
        tail.poll()
    failed = [(node, code, log) for node, code, log in logs if code != 0]
    if failed:
        detail = "\n".join(f"--- node {node} exited with {code}:\n{log[-5000:]}" for node, code, log in logs)
        raise RuntimeError(f"{prefix}: node(s) {[f[0] for f in failed]} failed\n{detail}")


def run(args) -> dict:
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="birder-throughput-"))
    out = work / "records.jsonl"
    testbeds = {}
    jobs = [(p, m) for p in args.profiles for m in args.models]
    print(f"throughput: {len(jobs)} jobs (profile x model), batches {args.batches}; records in {out}", flush=True)
    for profile in args.profiles:
        if args.local:
            tb, info, bw = None, {"profile": "local", "note": "all ranks on one host's loopback"}, None
        else:
            tb = testbed.Testbed(
                profile, rate_mbit=args.rate_mbit if profile == "ethernet" else None, nodes=args.nodes
            )
            tb.start()
        try:
            if tb is not None:
                info = {k: v for k, v in tb.describe().items() if k not in ("namespaces",)}
                bw = testbed.measure_bandwidth(tb, nbytes=20_000_000 if profile == "ethernet" else 200_000_000)
                print(f"[{profile}] bandwidth (Mbit/s): " + ", ".join(f"{k} {v:.1f}" for k, v in bw.items()))
                link0 = [tb.link_bytes(n) for n in range(args.nodes)]
            testbeds[profile] = {"testbed": info, "bandwidth_mbit": bw}
            for model in args.models:
                k = jobs.index((profile, model)) + 1
                print(f"[job {k}/{len(jobs)}, {time.perf_counter() - t0:.0f} s] {profile} {model}", flush=True)
                tag = {"profile": "local" if args.local else profile, "rate_mbit": info.get("rate_mbit")}
                _run_job(args, tb, model, args.batches[model], tag, out, t0)
            if tb is not None:
                link1 = [tb.link_bytes(n) for n in range(args.nodes)]
                testbeds[profile]["link_bytes_total_rx_tx"] = [
                    [b[0] - a[0], b[1] - a[1]] for a, b in zip(link0, link1, strict=True)
                ]
        finally:
            if tb is not None:
                tb.close()
    records = [r for r in map(json.loads, out.read_text().splitlines()) if r["kind"] != "progress"]
    result = {
        "config": {
            "command": "python benchmarks/system/throughput.py " + " ".join(args.argv),
            "nodes": args.nodes,
            "nproc_per_node": args.nproc_per_node,
            "threads_per_rank": 1,
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "batches": args.batches,
            "seed_batches": {m: CONFIGS[m][1] for m in args.models},
            "rounds": args.rounds,
            "refs": args.refs,
            "wall_s": time.perf_counter() - t0,
        },
        "profiles": testbeds,
        "records": records,
    }
    result["summary"] = summarize(records)
    result["targets"] = check_targets(result["summary"])
    return result


# ------------------------------------------------------------------------------------------------------- analysis
def _refs(records: list[dict]) -> dict:
    refs: dict[tuple[str, str, int], dict[str, dict]] = {}
    for r in records:
        if r.get("kind") == "method" and r["method"].startswith("ref-"):
            refs.setdefault((r["profile"], r["model"], r["batch_per_proc"]), {})[r["method"]] = r
    return refs


def breakdown(rec: dict, refs: dict[str, dict]) -> dict | None:
    """Where a step's time goes, from the no-communication references measured in the same rounds.

    With CPU times (``cpu_s``: CPU seconds of the busiest rank's process, all threads), robust to the machine's load:

    - compute: ``ref-compute``'s CPU seconds (forward, backward, the optimizer; a hook that sends nothing);
    - codec: the method's reference on a one-rank group (``ref-fp16``, ``ref-powersgd``, ``ref-birder``,
      ``ref-onebitadam``) minus that (fp32: 0): compressing, decompressing and, for Birder and 1-bit Adam, their own
      optimizer in place of AdamW/SGDM;
    - comm CPU: the method's CPU seconds minus its reference's: what the real exchange costs the CPU (gloo's copies
      and reductions, the kernel's TCP work, decoding n votes instead of one);
    - waiting: wall time minus CPU time: the network time backward did not hide, the other rank, and, on this
      shared machine, waiting for a core.

    Without CPU times (older records) the same split on wall-clock forward+backward times; noisier.
    """
    if "ref-compute" not in refs:
        return None
    ref = _own_ref(rec)
    base = refs["ref-compute"]
    if rec.get("cpu_s") is not None and base.get("cpu_s") is not None:
        compute = base["cpu_s"]
        codec = max(0.0, refs[ref]["cpu_s"] - compute) if ref in refs else 0.0  # fp32; or no reference measured
        comm_cpu = max(0.0, rec["cpu_s"] - compute - codec)
        return {
            "basis": "cpu",
            "compute_s": compute,
            "codec_s": codec,
            "comm_cpu_s": comm_cpu,
            "wait_s": rec["step_s_mean"] - compute - codec - comm_cpu,
        }
    fwd_bwd = base["fwd_bwd_s"]
    opt_s = refs["ref-birder"]["opt_s"] if rec["optimizer"] == "birder" and "ref-birder" in refs else rec["opt_s"]
    codec = max(0.0, refs[ref]["fwd_bwd_s"] - fwd_bwd) if ref in refs else 0.0
    compute = fwd_bwd + opt_s
    return {
        "basis": "wall",
        "compute_s": compute,
        "codec_s": codec,
        "comm_cpu_s": None,
        "wait_s": rec["step_s_mean"] - compute - codec,
    }


def summarize(records: list[dict]) -> list[dict]:
    refs = _refs(records)
    rows = []
    methods = [r for r in records if r.get("kind") == "method" and not r["method"].startswith("ref-")]
    for r in methods:
        key = (r["profile"], r["model"], r["batch_per_proc"])
        same = {m["method"]: m for m in methods if (m["profile"], m["model"], m["batch_per_proc"]) == key}
        base = same.get(PRIMARY.get(r["model"], "fp32-sgdm"))
        row = {
            "profile": r["profile"],
            "model": r["model"],
            "batch_per_proc": r["batch_per_proc"],
            "method": r["method"],
            "optimizer": r["optimizer"],
            "samples_per_s": r["samples_per_s"],
            "step_s": r["step_s_mean"],
            "step_s_per_round": r["step_s"],
            "timed_steps": r["timed_steps"],
            "ratio_vs_fp32": r["samples_per_s"] / base["samples_per_s"] if base else None,
            "baseline": base["method"] if base else None,
        }
        for b in ("fp32-adamw", "fp32-sgdm"):
            if b in same:
                row[f"ratio_vs_{b}"] = r["samples_per_s"] / same[b]["samples_per_s"]
        # CPU seconds per step (busiest rank): independent of how long the ranks waited for a core
        row["cpu_s"] = r.get("cpu_s")
        cpu_ok = base is not None and r.get("cpu_s") and base.get("cpu_s")
        row["cpu_ratio_vs_fp32"] = base["cpu_s"] / r["cpu_s"] if cpu_ok else None
        row["inter_node_tx_bytes_per_step"] = r.get("inter_node_tx_bytes_per_step")
        cs = r.get("commstats_per_step") or {}
        row["commstats_inter_bytes_per_step"] = cs.get("inter_node_bytes")
        row["commstats_intra_bytes_per_step"] = cs.get("intra_node_bytes")
        row["analytic_bytes_per_rank"] = r.get("analytic_bytes_per_rank")
        row["breakdown"] = breakdown(r, refs.get(key, {}))
        row.update(bounds(r, base, refs.get(key, {})))
        rows.append(row)
    return rows


def _own_ref(rec: dict) -> str:
    """The method's one-rank reference: its codec and optimizer without the wire (every Birder method: ref-birder)."""
    return "ref-birder" if rec["method"].startswith("birder") else f"ref-{rec['method']}"


def bounds(rec: dict, base: dict | None, refs: dict[str, dict]) -> dict:
    """The most a method could gain over fp32 with a free network, from the references of the same rounds (wall time):

    - ``bound_vs_fp32``: fp32's step over ``ref-compute``'s (forward, backward, the baseline optimizer, no wire);
    - ``codec_bound_vs_fp32``: fp32's step over the method's own one-rank reference (its codec and optimizer too);
    - ``share_of_bound``: the method's ratio over ``bound_vs_fp32``.
    """
    nocomm = refs.get("ref-compute")
    own = refs.get(_own_ref(rec))
    if base is None or nocomm is None:
        keys = ("bound_vs_fp32", "codec_bound_vs_fp32", "share_of_bound", "share_of_bound_paired_median",
                "ratio_vs_fp32_paired_median")  # fmt: skip
        return dict.fromkeys(keys)
    bound = base["step_s_mean"] / nocomm["step_s_mean"]
    ratio = base["step_s_mean"] / rec["step_s_mean"]
    return {
        "bound_vs_fp32": bound,
        "codec_bound_vs_fp32": base["step_s_mean"] / own["step_s_mean"] if own else bound,
        "share_of_bound": ratio / bound,
        # the same per round (each method's i-th timed step ran in round i), then the median over rounds: robust to a
        # load change between rounds, which moves every method of a round alike
        "share_of_bound_paired_median": _paired_median(nocomm, rec),
        "ratio_vs_fp32_paired_median": _paired_median(base, rec),
    }


def _paired_median(a: dict, b: dict) -> float | None:
    """Median over rounds of ``a``'s step over ``b``'s step in the same round."""
    pairs = [x / y for x, y in zip(a.get("step_s") or [], b.get("step_s") or [])]
    return statistics.median(pairs) if pairs else None


def check_targets(rows: list[dict]) -> list[dict]:
    """Birder hierarchical's rows against ``TARGETS`` (and ``AHEAD_OF``: its step shorter than that method's)."""
    out = []
    for row in rows:
        if row["method"] != "birder-hierarchical":
            continue
        key = (row["profile"], row["model"], row["batch_per_proc"])
        goal = TARGETS.get(key) or TARGETS.get((*key[:2], None))
        if goal is None or row.get(goal[0]) is None:
            continue
        measure, at_least = goal
        target = {"profile": key[0], "model": key[1], "batch_per_proc": key[2], "method": row["method"],
                  "measure": measure, "value": row[measure], "target": at_least, "met": row[measure] >= at_least,
                  "ratio_vs_fp32": row["ratio_vs_fp32"]}  # fmt: skip
        rival = AHEAD_OF.get(key)
        same = [r for r in rows if (r["profile"], r["model"], r["batch_per_proc"]) == key]
        other = next((r for r in same if r["method"] == rival), None)
        if other is not None:
            mine, theirs = row.get("step_s_per_round") or [], other.get("step_s_per_round") or []
            rounds_ahead = sum(a < b for a, b in zip(mine, theirs))
            target.update(ahead_of=rival, rival_step_s=other["step_s"], step_s=row["step_s"],
                          rounds_ahead=rounds_ahead, rounds=min(len(mine), len(theirs)))  # fmt: skip
            target["met"] = target["met"] and row["step_s"] < other["step_s"]
        paired = row.get(measure + "_paired_median")
        if paired is not None:  # the per-round estimate, beside the mean's (not what decides "met")
            target["value_paired_median"] = paired
        out.append(target)
    return out


def table(result: dict) -> str:
    """Markdown table of the summary (samples/s, ratio, bytes, breakdown)."""
    lines = [
        "| profile | model | batch/proc | method | samples/s | x fp32 | bound | share of bound | bound with codec "
        "| s/step | CPU s/step | x fp32 (CPU) | compute | codec | comm CPU | waiting | inter-node MB/step (link) "
        "| CommStats inter MB |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["summary"]:
        b = r["breakdown"] or {}
        link = r["inter_node_tx_bytes_per_step"]
        cs = r["commstats_inter_bytes_per_step"]

        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"

        lines.append(
            f"| {r['profile']} | {r['model']} | {r['batch_per_proc']} | {LABELS.get(r['method'], r['method'])} "
            f"| {r['samples_per_s']:.3g} | {f(r['ratio_vs_fp32'], '.2f')} | {f(r.get('bound_vs_fp32'), '.2f')} "
            f"| {f(r.get('share_of_bound'), '.2f')} | {f(r.get('codec_bound_vs_fp32'), '.2f')} | {r['step_s']:.3g} "
            f"| {f(r.get('cpu_s'), '.3g')} | {f(r.get('cpu_ratio_vs_fp32'), '.2f')} "
            f"| {f(b.get('compute_s'), '.3g')} | {f(b.get('codec_s'), '.3g')} | {f(b.get('comm_cpu_s'), '.3g')} "
            f"| {f(b.get('wait_s'), '.3g')} "
            f"| {f(None if link is None else link / 1e6, '.1f')} | {f(None if cs is None else cs / 1e6, '.1f')} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------- CLI
def _parse_batches(items: list[str], models: list[str]) -> dict[str, list[int]]:
    batches = {m: list(CONFIGS[m][0]) for m in models}
    for item in items or []:
        model, _, values = item.partition("=")
        if model not in CONFIGS or not values:
            raise SystemExit(f"--batches expects MODEL=B1,B2 with MODEL in {sorted(CONFIGS)}, got {item!r}")
        batches[model] = [int(v) for v in values.split(",")]
    return batches


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", nargs="+", default=["ib", "ethernet"], choices=testbed.PROFILES)
    ap.add_argument("--rate-mbit", type=float, default=None, help="ethernet rate (default: the testbed's 150)")
    ap.add_argument("--models", nargs="+", default=["bert", "resnet50"], choices=sorted(CONFIGS))
    ap.add_argument("--batches", nargs="*", default=[], help="override, e.g. bert=2,10 resnet50=5,20")
    ap.add_argument("--methods", nargs="+", default=None, choices=METHODS, help="default: see methods_for()")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--nproc-per-node", type=int, default=1, help="2 oversubscribes the 2 cores of this machine")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds; each method runs one step per round")
    ap.add_argument("--no-refs", dest="refs", action="store_false", help="skip the breakdown's references")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per job")
    ap.add_argument("--local", action="store_true", help="no testbed: all ranks on loopback (profile 'local')")
    ap.add_argument("--out", default="docs/results/throughput.json")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument(
        "--from-records",
        nargs="+",
        default=None,
        metavar="FILE",
        help="no run: re-summarize saved results (throughput JSON or worker JSON lines); for a (profile, model, "
        "batch) measured in several files, the last file wins",
    )
    args = ap.parse_args(argv)
    args.argv = argv
    args.batches = _parse_batches(args.batches, args.models)
    if args.from_records:
        return _resummarize(args)
    if not args.local:
        ok, reason = testbed.available()
        if not ok:
            print(f"testbed unavailable ({reason}); use --local to run every rank on loopback", file=sys.stderr)
            return 2
    if args.local:
        args.profiles = args.profiles[:1]
    result = run(args)
    return _write(args, result)


def _resummarize(args) -> int:
    records, configs, profiles = {}, [], {}
    for name in args.from_records:
        text = Path(name).read_text()
        if name.endswith(".json"):
            saved = json.loads(text)
            recs = saved["records"]
            configs.append(saved["config"])
            profiles.update(saved.get("profiles", {}))
        else:
            recs = [json.loads(line) for line in text.splitlines()]
        by_config: dict[tuple, list] = {}
        for r in recs:
            if r.get("kind") in ("meta", "method"):
                by_config.setdefault((r.get("profile"), r["model"], r["batch_per_proc"]), []).append(r)
        records.update(by_config)  # a later file replaces a whole (profile, model, batch)
    flat = [r for recs in records.values() for r in recs]
    config = {**(configs[0] if configs else {}), "merged_from": list(args.from_records)}
    config["reruns"] = configs[1:]
    result = {"config": config, "profiles": profiles, "records": flat}
    result["summary"] = summarize(flat)
    result["targets"] = check_targets(result["summary"])
    return _write(args, result)


def _write(args, result: dict) -> int:
    result = {**result, **provenance(__file__, args.argv)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    md = table(result)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    for t in result["targets"]:
        rival = f"; step {t['step_s']:.3g} s, {t['ahead_of']} {t['rival_step_s']:.3g} s" if "ahead_of" in t else ""
        print(
            f"target {t['profile']} {t['model']} b{t['batch_per_proc']} {t['method']}: {t['measure']} "
            f"{t['value']:.2f} (>= {t['target']}){rival}: {'met' if t['met'] else 'MISSED'}"
        )
    if not args.no_plots:
        import plots

        for path in plots.throughput_figures(result, out.parent, stem=out.stem):
            print("wrote", path)
    print(f"wrote {out} ({result['config'].get('wall_s', 0):.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
