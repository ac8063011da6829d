"""Time to accuracy on a slow link: Birder against fp32 DDP, fp16, PowerSGD (rank 1 and 4) and 1-bit Adam.

The question a user asks before choosing a compressor: which method reaches the target quality first, in wall-clock
time, on a slow network? On one machine it is answered in two measurements that are composed, and checked:

1. **Quality per step** (``curves``): every method trains each task for the same steps, on the same batches, from the
   same weights, 3 seeds, 4 ranks as 2 nodes x 2 on loopback (``_tta_worker.py``). What a method computes does not
   depend on the link (the arithmetic is the same bit for bit whatever carries the bytes), so loopback gives each
   method's metric after every evaluated step at the speed of the CPU.
2. **Time per step on the link** (``steptime``): the same processes in two network namespaces (two emulated nodes,
   ``testbed.py``) joined by a shaped link, each method for a few timed steps. Methods with an fp32 warm-up
   (PowerSGD, 1-bit Adam) are timed in both phases.

The wall-clock curve of a method is its quality after step s against the sum of its measured step times up to s
(evaluation excluded). ``validate`` runs Birder hierarchical and PowerSGD rank 4 for their whole length on the link
and compares the measured seconds with the composed ones.

**The link rate** (``--rate-mbit``, per task): what matters is the ratio of communication to computation. On 2 nodes
of 8 A100s joined by 10 GbE (94% goodput), an fp32 ring all-reduce sends 2(n-1)/n = 1.875x the gradient through each
node's NIC: BERT-Base (435.6 MB of gradient) 0.695 s, ResNet-50 (102.2 MB) 0.163 s per step. The A100 computes a
step of 128 samples per GPU (the paper's larger batch) in 0.118 s (BERT-Base, 1083.7 samples/s) and 0.136 s
(ResNet-50, 938 samples/s; both in ``docs/results/cost_model.json``): ratios 5.9 and 1.2. ``calibrate`` measures
each task's compute time per step here (no communication) and the bytes an fp32 step sends across the link, and sets
the link rate so that the fp32 step shows the same ratio (``qa`` and ``lm`` take BERT-Base's, ``image``
ResNet-50's).

    python benchmarks/system/tta.py all          # calibrate, tune, curves, steptime, validate, report (hours)
    python benchmarks/system/tta.py curves --tasks qa --seeds 0
    python benchmarks/system/tta.py report       # table + plots from what is in --work

Learning rates: tuned on seed 0 from a grid per method (``GRIDS``), best final metric; a best value at an end of
the grid extends the grid past it (halving or doubling, 6 values at most); methods in ``SHARED_LR`` take the tuned
value of the method they are a drop-in for (``--tune-all`` tunes them too); no method is tuned down.
Results: ``docs/results/tta.json``, ``tta_table.md``, ``tta.png`` (metric against seconds, one panel per task).

**Local steps** (``local10``: ``LocalSteps`` with H = 10 and the 1-bit outer exchange; ``local10-fp32``: fp32
DiLoCo; the outer step per task in ``_tta_worker.OUTER``) take DDP fp32's learning rate for their inner AdamW, or
their own with ``--tune-all``. ``restore`` puts a stored report's rates, learning rates
and curves back into ``--work``, so that new methods can be measured beside them; ``--slower K`` runs the link phases
(and reports) on a link K times slower than the calibrated one.
Runs are resumable: a run whose JSON lines are complete is read, not run again. Namespace phases need root.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent))
from provenance import provenance  # noqa: E402

ROOT = _HERE.parents[1]
WORKER = _HERE / "_tta_worker.py"
METHODS = (
    "fp32",
    "fp16",
    "powersgd-r1",
    "powersgd-r4",
    "onebitadam",
    "birder-h",
    "birder-flat",
    "local10",
    "local10-fp32",
)
LABELS = {
    "fp32": "DDP fp32",
    "fp16": "fp16 hook",
    "powersgd-r1": "PowerSGD rank 1",
    "powersgd-r4": "PowerSGD rank 4",
    "onebitadam": "1-bit Adam",
    "birder-h": "Birder hierarchical",
    "birder-flat": "Birder flat (allgather)",
    "local10": "local steps H=10, 1-bit outer",
    "local10-fp32": "local steps H=10, fp32 outer (DiLoCo)",
}
COLORS = {
    "fp32": "#4c72b0",
    "fp16": "#55a868",
    "powersgd-r1": "#8172b2",
    "powersgd-r4": "#64b5cd",
    "onebitadam": "#9467bd",
    "birder-h": "#d94801",
    "birder-flat": "#fdae6b",
    "local10": "#a50f15",
    "local10-fp32": "#737373",
}
PRIMARY = {
    "qa": ("f1", True, "SQuAD F1"),
    "image": ("top1", True, "top-1 (%)"),
    "lm": ("perplexity", False, "val. ppl"),
}
TITLES = {"qa": "QA (tiny BERT)", "image": "image (ResNet-18)", "lm": "causal LM (tiny GPT-2), 2 nodes x 2"}
# comm/compute ratio of an fp32 step on 2 x 8 A100 over 10 GbE at 128 samples per GPU (module docstring)
RATIO = {"qa": 0.695 / (128 / 1083.71), "lm": 0.695 / (128 / 1083.71), "image": 0.163 / (128 / 938.0)}
# learning-rate grids (seed 0); the base optimizer of fp32/fp16/PowerSGD is AdamW (qa, lm) or SGDM (image)
GRIDS = {
    "qa": {"adam": [1e-3, 2e-3, 4e-3], "birder": [2e-3, 4e-3, 8e-3]},
    "image": {"sgd": [0.05, 0.1, 0.2], "adam": [1e-3, 2e-3, 4e-3], "birder": [2e-3, 4e-3, 8e-3]},
    # Birder on this task: 5e-4 was the best of 2e-4 / 5e-4 / 2e-3 in the recipe's check (docs/results/hsdp_lr_check_*)
    "lm": {"adam": [1e-3, 2e-3, 4e-3], "birder": [2.5e-4, 5e-4, 1e-3]},
}
STEPS = {"qa": 600, "image": 600, "lm": 600}
EVAL_EVERY = {"qa": 50, "image": 50, "lm": 50}


# methods that take another method's tuned learning rate (same optimizer; the hook is a drop-in for DDP's
# all-reduce), unless --tune-all: what a user switching on fp16 or PowerSGD does, and it halves the tuning runs
SHARED_LR = {
    "fp16": "fp32",
    "powersgd-r1": "fp32",
    "powersgd-r4": "fp32",
    "birder-flat": "birder-h",
    "local10": "fp32",
    "local10-fp32": "fp32",
}  # local steps: DDP's inner optimizer at DDP's rate


def local_steps(method: str) -> int:
    """H of a local-step method (``local10``: 10), 0 for a method that exchanges on every step."""
    return int(method[len("local") :].split("-")[0]) if method.startswith("local") else 0


def grid(task: str, method: str) -> list[float]:
    if method.startswith("birder"):
        return GRIDS[task]["birder"]
    if method == "onebitadam" or task != "image":
        return GRIDS[task]["adam"]
    return GRIDS[task]["sgd"]


# ------------------------------------------------------------------------------------------------------- running
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _complete(path: Path) -> bool:
    if not path.exists():
        return False
    return any(json.loads(line).get("kind") == "done" for line in path.read_text().splitlines() if line.strip())


def _worker_args(task, method, lr, seed, args, out: Path, *, steps=None, extra=()) -> list[str]:
    return [
        str(WORKER),
        "--task", task, "--method", method, "--lr", str(lr), "--seed", str(seed),
        "--steps", str(steps or args.steps or STEPS[task]), "--eval-every", str(EVAL_EVERY[task]),
        "--batch", str(args.batch), "--work", str(args.work / "data"), "--out", str(out), *extra,
    ]  # fmt: skip


def run_local(task, method, lr, seed, args, out: Path, **kw) -> None:
    """4 ranks (2 simulated nodes x 2) on loopback."""
    if _complete(out):
        return
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port())]  # fmt: skip
    kw["extra"] = ["--nodes", "2", *kw.get("extra", ())]
    cmd += _worker_args(task, method, lr, seed, args, out, **kw)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": str(ROOT / "src")}
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{out.name} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    print(f"  {out.name}: {time.perf_counter() - t0:.0f} s (load {os.getloadavg()[0]:.1f})", flush=True)


def run_testbed(tb, task, method, lr, seed, args, out: Path, **kw) -> None:
    """2 namespaces x (nproc / 2) ranks over the shaped link."""
    if _complete(out):
        return
    out.unlink(missing_ok=True)
    argv = _worker_args(task, method, lr, seed, args, out, **kw)
    runs = tb.launch_torchrun(Path(argv[0]), nproc_per_node=args.nproc // 2, args=argv[1:], timeout=args.timeout,
                              env={"PYTHONPATH": str(ROOT / "src")})  # fmt: skip
    if not all(r.ok for r in runs):
        raise RuntimeError(f"{out.name} failed on the testbed:\n" + "\n".join(r.log[-3000:] for r in runs))


def _merge(path: Path, per_task: dict) -> None:
    """Write ``per_task`` into the JSON file at ``path``, keeping the tasks, and the entries of a task (a method's
    learning rate), that this run did not touch (tasks and methods are calibrated and tuned a few at a time)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    for task, value in per_task.items():
        both = isinstance(value, dict) and isinstance(old.get(task), dict)
        old[task] = {**old[task], **value} if both else value
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(old, indent=1))
    os.replace(tmp, path)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def final_metric(records: list[dict], task: str) -> float:
    key, _, _ = PRIMARY[task]
    return [r for r in records if r.get("kind") == "eval"][-1][key]


# -------------------------------------------------------------------------------------------------------- phases
def tune(args) -> dict:
    """Seed 0, each method over its grid on loopback; the best final metric picks the learning rate."""
    best = {}
    for task in args.tasks:
        higher = PRIMARY[task][1]
        for method in sorted(args.methods, key=lambda m: m in SHARED_LR):  # the methods others share first
            if method in SHARED_LR and not args.tune_all and SHARED_LR[method] in best.get(task, {}):
                source = SHARED_LR[method]
                best[task][method] = {"lr": best[task][source]["lr"], "grid": f"shared with {source}"}
                print(f"[tune] {task} {method}: {source}'s -> {best[task][method]['lr']:g}", flush=True)
                continue
            scores, todo = {}, list(grid(task, method))
            while todo:
                lr = todo.pop(0)
                out = args.work / "tune" / f"{task}-{method}-lr{lr:g}.jsonl"
                out.parent.mkdir(parents=True, exist_ok=True)
                run_local(task, method, lr, 0, args, out)
                scores[lr] = final_metric(read(out), task)
                if not todo:  # the best at an end of the grid: extend the grid past it (x2 or /2) until it is inside
                    pick = (max if higher else min)(scores, key=scores.get)
                    ends = min(scores), max(scores)
                    if pick in ends and len(scores) < 6:
                        todo.append(pick / 2 if pick == ends[0] else pick * 2)
            pick = (max if higher else min)(scores, key=scores.get)
            best.setdefault(task, {})[method] = {"lr": pick, "grid": scores}
            print(f"[tune] {task} {method}: {scores} -> {pick:g}", flush=True)
            _merge(args.work / "tuned.json", {task: {method: best[task][method]}})  # usable before the others finish
    return best


def tuned(args) -> dict:
    path = args.work / "tuned.json"
    if not path.exists():
        raise SystemExit(f"{path} is missing: run the 'tune' phase first")
    return json.loads(path.read_text())


def curves(args) -> None:
    lrs = tuned(args)
    for seed in args.seeds:
        for task in args.tasks:
            for method in args.methods:
                out = args.work / "curves" / f"{task}-{method}-seed{seed}.jsonl"
                out.parent.mkdir(parents=True, exist_ok=True)
                if seed == 0:  # the tuning run is this run where it ran as many steps: same task, method, lr, seed
                    src = args.work / "tune" / f"{task}-{method}-lr{lrs[task][method]['lr']:g}.jsonl"
                    same = _complete(src) and read(src)[0].get("steps") == (args.steps or STEPS[task])
                    if same and not out.exists():
                        out.write_text(src.read_text())
                run_local(task, method, lrs[task][method]["lr"], seed, args, out)


def restore(args) -> None:
    """Put a stored report's link rates, learning rates and quality curves back into ``--work``, so that new methods'
    curves and every method's step times can be measured beside them without running the stored curves again (what
    a method computes does not depend on the link). A restored curve holds the stored evaluations, the stored
    loopback seconds per step, and the file it came from; the methods that share another's rate (``SHARED_LR``) and
    are not in the stored report get it."""
    stored = json.loads(args.restore_from.read_text())
    source = _rel(args.restore_from)
    lrs = stored["tuned"]
    for task in lrs:
        for method, other in SHARED_LR.items():
            if method not in lrs[task] and other in lrs[task]:
                lrs[task][method] = {"lr": lrs[task][other]["lr"], "grid": f"shared with {other}"}
    for name, value in (("rates", stored["rates"]), ("tuned", lrs)):
        if not (args.work / f"{name}.json").exists():
            _merge(args.work / f"{name}.json", value)
    seeds = stored["config"]["seeds"]
    for task, t in stored["tasks"].items():
        key = PRIMARY[task][0]
        for method, m in t["methods"].items():
            if len(m["per_seed"]) != len(seeds):
                raise SystemExit(f"{source}: {task} {method} has {len(m['per_seed'])} seeds, not {seeds}")
            for seed, values, loop_s in zip(seeds, m["per_seed"], m["loopback_s_per_step"]):
                out = args.work / "curves" / f"{task}-{method}-seed{seed}.jsonl"
                if _complete(out):
                    continue
                out.parent.mkdir(parents=True, exist_ok=True)
                head = {"task": task, "method": method, "lr": m["lr"], "seed": seed, "steps": t["steps"],
                        "batch_per_proc": t["batch_per_proc"], "restored_from": source}  # fmt: skip
                recs = [{**head, "kind": "eval", "step": p, key: v} for p, v in zip(m["steps"], values)]
                recs.append({**head, "kind": "done", "loopback_s_per_step": loop_s})
                out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    print(f"[restore] {source} -> {_rel(args.work)}", flush=True)


def _compute_and_bytes(tb, task, args) -> tuple[float, float]:
    """Seconds per step of the fp32 method on an unshaped link (nearly all compute), and fp32 bytes per step that
    leave node 0 through its link."""
    out = args.work / "calibrate" / f"{task}-fp32.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    rx0, tx0 = tb.link_bytes(0)
    run_testbed(tb, task, "fp32", 1e-3, 0, args, out, steps=args.time_steps, extra=["--no-eval"])
    rx1, tx1 = tb.link_bytes(0)
    done = [r for r in read(out) if r.get("kind") == "done"][-1]
    step_s = statistics.median(done["step_s"][2:])
    return step_s, (tx1 - tx0) / len(done["step_s"])


def calibrate(args) -> dict:
    """The link rate per task that gives an fp32 step the A100 / 10 GbE communication-to-computation ratio."""
    import testbed

    rates = {}
    with testbed.Testbed("ib", nodes=2) as tb:
        for task in args.tasks:
            compute_s, nbytes = _compute_and_bytes(tb, task, args)
            rate = 8 * nbytes / (RATIO[task] * compute_s) / 1e6
            rates[task] = {"compute_s": compute_s, "fp32_bytes_per_step": nbytes, "ratio": RATIO[task],
                           "rate_mbit": rate}  # fmt: skip
            print(
                f"[calibrate] {task}: {compute_s:.3f} s/step compute, {nbytes / 1e6:.2f} MB fp32 -> {rate:.1f} Mbit/s"
            )
    _merge(args.work / "rates.json", rates)
    return rates


def _dir(args, phase: str) -> str:
    """The folder of a link phase's runs: ``steptime``, or ``steptime-slow10`` on a link ``--slower 10`` times
    slower than the calibrated one."""
    slower = getattr(args, "slower", 1)  # other harnesses pass only work=
    return phase if slower == 1 else f"{phase}-slow{slower:g}"


def _on_link(args, phase: str, methods, **kw) -> list[tuple]:
    """Run ``methods`` of every task on the shaped link (one testbed per task, at the task's calibrated rate divided
    by ``--slower``) into ``<work>/<phase>/<task>-<method>.jsonl``; returns (task, method, path, node 0's link bytes
    sent) for the runs made now (``None`` bytes for the runs already complete)."""
    import testbed

    rates = json.loads((args.work / "rates.json").read_text())
    lrs, made = tuned(args), []
    for task in args.tasks:
        with testbed.Testbed("ethernet", nodes=2, rate_mbit=rates[task]["rate_mbit"] / args.slower) as tb:
            for method in methods:
                out = args.work / _dir(args, phase) / f"{task}-{method}.jsonl"
                out.parent.mkdir(parents=True, exist_ok=True)
                if _complete(out):
                    made.append((task, method, out, None))
                    continue
                _, tx0 = tb.link_bytes(0)
                steps = kw.get("steps")
                if steps and local_steps(method):  # the first exchange carries one-off set-up: time two more
                    steps = max(steps, 3 * local_steps(method))
                run_testbed(tb, task, method, lrs[task][method]["lr"], 0, args, out, **{**kw, "steps": steps})
                made.append((task, method, out, tb.link_bytes(0)[1] - tx0))
    return made


def steptime(args) -> None:
    """Each method's seconds per step on the shaped link (and the fp32 warm-up phase of PowerSGD / 1-bit Adam)."""
    # the warm-up share is set so that both phases get timed steps: half fp32, half compressed
    runs = _on_link(args, "steptime", args.methods, steps=args.time_steps, extra=["--no-eval", "--warmup-frac", "0.5"])
    for _, _, out, sent in runs:
        if sent is not None:
            steps = len([r for r in read(out) if r.get("kind") == "done"][-1]["step_s"])
            with open(out, "a") as f:  # what node 0 sent over its link, all timed steps together
                f.write(json.dumps({"kind": "link", "node0_tx_bytes": sent, "steps": steps}) + "\n")


def validate(args) -> None:
    """Whole runs on the link (seed 0) for the methods in --validate, to check the composed clock."""
    _on_link(args, "validate", args.validate)


# -------------------------------------------------------------------------------------------------------- report
def _phase_times(task: str, method: str, args) -> tuple[float, float]:
    """(seconds per fp32-phase step, seconds per compressed step) on the link, from the steptime run; for a
    local-step method (seconds per inner step, seconds per step that ends with the exchange and outer step)."""
    rec = [r for r in read(args.work / _dir(args, "steptime") / f"{task}-{method}.jsonl") if r.get("kind") == "done"]
    s = rec[-1]["step_s"]
    if method.startswith("powersgd") or method == "onebitadam":
        half = len(s) // 2
        return statistics.median(s[2:half]), statistics.median(s[half + 2 :])
    if h := local_steps(method):
        # the ranks meet only at the exchange, so a round (H inner steps and the exchange) takes the same wall time on
        # every rank, while the slowest rank of each step double-counts the skew the exchange absorbs: the outer
        # step's time is a round's median (over the ranks and the rounds after the first, whose exchange sets up its
        # groups and kernels) less H - 1 inner steps
        ranks = rec[-1]["step_s_per_rank"]
        inner = statistics.median(t for r in ranks for i, t in enumerate(r, 1) if i > 2 and i % h)
        rounds = [sum(r[k : k + h]) for r in ranks for k in range(h, len(r) - h + 1, h)]
        return inner, statistics.median(rounds) - (h - 1) * inner
    t = statistics.median(s[2:])
    return t, t


def _link_mb(task: str, method: str, args) -> float | None:
    """MB node 0 sent over its link per compressed step in the steptime run (for the methods with an fp32 warm-up,
    half of whose timed steps were fp32: their mean minus fp32's share)."""

    def per_step(m):
        rec = [r for r in read(args.work / _dir(args, "steptime") / f"{task}-{m}.jsonl") if r.get("kind") == "link"]
        if not rec:
            return None
        # a local-step method sends only at its steps // H exchanges: per inner step, one exchange over H
        h = local_steps(m)
        steps = rec[-1]["steps"] // h * h if h else rec[-1]["steps"]
        return rec[-1]["node0_tx_bytes"] / steps / 1e6

    mean = per_step(method)
    if mean is None or not (method.startswith("powersgd") or method == "onebitadam"):
        return mean
    fp32 = per_step("fp32")
    return None if fp32 is None else 2 * mean - fp32


def composed_clock(task, method, steps: int, warmup_frac: float, args) -> list[float]:
    """Seconds of training on the link after each step 0..steps."""
    return phase_clock(*_phase_times(task, method, args), method, steps, warmup_frac)


def phase_clock(fp32_phase: float, compressed: float, method: str, steps: int, warmup_frac: float) -> list[float]:
    """Seconds after each step 0..steps: PowerSGD and 1-bit Adam run their first ``warmup_frac`` of the steps (the
    worker's ``--warmup-frac``, at least 2) at the fp32 phase's rate, every other step at the compressed rate. A
    local-step method's (inner, outer) times: every H-th step at the outer rate, the others at the inner."""
    warm = max(2, round(warmup_frac * steps)) if (method.startswith("powersgd") or method == "onebitadam") else 0
    h = local_steps(method)
    clock, t = [0.0], 0.0
    for s in range(1, steps + 1):
        t += compressed if (s % h == 0 if h else s > warm) else fp32_phase
        clock.append(t)
    return clock


def _loopback_step_s(records: list[dict]) -> float:
    """Median seconds per step of a quality run on loopback (no slow link) after its first 10% (warm-ups): the
    method's compute and codec cost without the link's (a restored run carries the stored value)."""
    done = [r for r in records if r.get("kind") == "done"][-1]
    if "loopback_s_per_step" in done:
        return done["loopback_s_per_step"]
    s = done["step_s"]
    return statistics.median(s[len(s) // 10 :])


def _first_reached(seconds, curve, target, higher) -> float | None:
    """The first time (s) at which ``curve`` reaches ``target``, or None."""
    hits = [t for t, v in zip(seconds, curve) if target is not None and (v >= target if higher else v <= target)]
    return hits[0] if hits else None


def _at(seconds, curve, budget) -> float:
    """The value of ``curve`` at the last evaluation within ``budget`` seconds."""
    return [v for t, v in zip(seconds, curve) if t <= budget][-1]


def _rel(path: Path) -> str:
    """``path`` relative to the repository where it is inside it (results carry no machine paths)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def report(args) -> dict:
    lrs = tuned(args)
    # steps and batch are per task (read from the runs' records below), not this invocation's
    config = {k: (_rel(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("steps", "batch")}
    result = {"config": config, **provenance(__file__),
              "rates": json.loads((args.work / "rates.json").read_text()), "tuned": lrs, "tasks": {}}  # fmt: skip
    for task in args.tasks:
        key, higher, label = PRIMARY[task]
        per_method, setting = {}, {"steps": None, "batch_per_proc": None}
        for method in args.methods:
            runs = [read(args.work / "curves" / f"{task}-{method}-seed{s}.jsonl") for s in args.seeds]
            runs = [r for r in runs if any(x.get("kind") == "done" for x in r)]
            if not runs:
                continue
            steps = runs[0][0]["steps"]
            if method == "fp32" or setting["steps"] is None:  # the task's setting is the reference's
                setting = {"steps": steps, "batch_per_proc": runs[0][0].get("batch_per_proc")}
            clock = composed_clock(task, method, steps, 0.1, args)
            evals = [[e for e in r if e.get("kind") == "eval"] for r in runs]
            points = [e["step"] for e in evals[0]]
            values = [[e[key] for e in ev] for ev in evals]
            # median and range over the seeds: a seed that stalls or diverges (the 1-bit methods here) would make a
            # mean and standard deviation describe no run at all
            median = [statistics.median(v[i] for v in values) for i in range(len(points))]
            per_method[method] = {"steps": points, "seconds": [clock[p] for p in points], "median": median,
                                  "min": [min(v[i] for v in values) for i in range(len(points))],
                                  "max": [max(v[i] for v in values) for i in range(len(points))],
                                  "per_seed": values, "final": [v[-1] for v in values], "seeds": len(runs),
                                  "run_steps": steps,
                                  "lr": lrs[task][method]["lr"], "s_per_step": _phase_times(task, method, args),
                                  "link_mb_per_step": _link_mb(task, method, args),
                                  "loopback_s_per_step": [_loopback_step_s(r) for r in runs]}  # fmt: skip
        ref = per_method.get("fp32")
        target = None
        if ref:
            final = statistics.median(ref["final"])
            target = 0.95 * final if higher else final / 0.95
        budget = min(m["seconds"][-1] for m in per_method.values()) if per_method else None
        for m in per_method.values():
            m["time_to_target_s"] = _first_reached(m["seconds"], m["median"], target, higher)
            m["time_to_target_per_seed_s"] = [_first_reached(m["seconds"], v, target, higher) for v in m["per_seed"]]
            m["at_budget"] = statistics.median(_at(m["seconds"], v, budget) for v in m["per_seed"])
        result["tasks"][task] = {"metric": key, "label": label, "target": target, "budget_s": budget,
                                 **setting,
                                 "methods": per_method}  # fmt: skip
        for method in args.validate:
            path = args.work / _dir(args, "validate") / f"{task}-{method}.jsonl"
            ev = [e for e in read(path) if e.get("kind") == "eval"]
            if ev and method in per_method:
                comp = composed_clock(task, method, ev[0]["steps"], 0.1, args)
                result["tasks"][task].setdefault("validation", {})[method] = [
                    {"step": e["step"], "measured_s": e["train_s"], "composed_s": comp[e["step"]], key: e[key]}
                    for e in ev
                ]
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.stem + ("" if args.slower == 1 else f"_slow{args.slower:g}")
    (args.results / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (args.results / f"{stem}_table.md").write_text(table(result))
    if not args.no_plots:
        plot(result, args.results / f"{stem}.png", args.slower)
    print(table(result))
    return result


def _num(x: float) -> str:
    return f"{x:.1f}" if abs(x) < 1e5 else f"{x:.2g}"


def table(result: dict) -> str:
    lines = []
    for task, t in result["tasks"].items():
        lines.append(f"**{task}** ({t['label']}; {t['steps']} steps of {t['batch_per_proc']} per rank; target = 95% "
                     f"of DDP fp32's median final: {t['target']:.2f}; budget {t['budget_s']:.0f} s)\n")  # fmt: skip
        lines.append(
            "| method | lr | s/step on the link (fp32 phase, compressed) | MB/step over the link (compressed) "
            "| time to target, median curve (s) | seeds reaching the target: time (s) | at budget (median) "
            "| final, median [min, max] |"
        )
        lines.append("|---|---:|---:|---:|---:|---|---:|---:|")
        for method, m in t["methods"].items():
            tt = "not reached" if m["time_to_target_s"] is None else f"{m['time_to_target_s']:.0f}"
            hits = [f"{x:.0f}" for x in m["time_to_target_per_seed_s"] if x is not None]
            seeds = f"{len(hits)} of {m['seeds']}" + (f": {', '.join(hits)}" if hits else "")
            mb = "–" if m.get("link_mb_per_step") is None else f"{m['link_mb_per_step']:.3f}"
            s_fp32, s_comp = m["s_per_step"]
            fin = m["final"]
            label = LABELS[method] + (
                f", {m['run_steps']} steps" if m.get("run_steps", t["steps"]) != t["steps"] else ""
            )
            lines.append(f"| {label} | {m['lr']:g} | {s_fp32:.3f}, {s_comp:.3f} | {mb} | {tt} | {seeds} | "
                         f"{_num(m['at_budget'])} | {_num(statistics.median(fin))} [{_num(min(fin))}, "
                         f"{_num(max(fin))}] |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path, slower: float = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        t = result["tasks"][task]
        for method, m in t["methods"].items():
            ax.plot(m["seconds"], m["median"], label=LABELS[method], color=COLORS[method])
            ax.fill_between(m["seconds"], m["min"], m["max"], color=COLORS[method], alpha=0.12)
        if t["target"] is not None:
            ax.axhline(t["target"], color="grey", ls="--", lw=0.8, label="95% of fp32's final")
        xlabel = "training seconds on the emulated link (evaluation excluded)"
        if slower != 1:
            xlabel = f"training seconds on a link {slower:g}x slower (evaluation excluded)"
        ax.set(title=TITLES[task], xlabel=xlabel, ylabel=t["label"])
        if not PRIMARY[task][1]:
            ax.set_yscale("log")
            # a seed that diverged (shown by its band) must not squash the curves that did not
            lows = [min(m["min"]) for m in t["methods"].values()]
            highs = [m["median"][1] for m in t["methods"].values() if len(m["median"]) > 1]
            if highs:
                ax.set_ylim(0.8 * min(lows), 2.0 * max(highs))
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    phases = ("calibrate", "tune", "curves", "steptime", "validate", "report", "all", "restore")
    ap.add_argument("phase", choices=phases)
    ap.add_argument("--tasks", nargs="+", default=["qa", "image"], choices=tuple(PRIMARY))
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: per task, STEPS)")
    ap.add_argument("--time-steps", type=int, default=24, help="timed steps per method in calibrate/steptime")
    ap.add_argument("--validate", nargs="*", default=["birder-h", "powersgd-r4"])
    ap.add_argument("--batch", type=int, default=8, help="samples per process per step")
    ap.add_argument("--nproc", type=int, default=4, help="processes (2 nodes x nproc/2)")
    ap.add_argument("--timeout", type=float, default=7200)
    ap.add_argument("--work", type=Path, default=ROOT / "outputs" / "tta")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--tune-all", action="store_true", help="tune every method (default: SHARED_LR share)")
    ap.add_argument("--slower", type=float, default=1, help="link phases at the calibrated rate / SLOWER")
    ap.add_argument("--stem", default="tta", help="results file names: STEM.json, STEM_table.md, STEM.png")
    ap.add_argument(
        "--restore-from",
        type=Path,
        default=ROOT / "docs" / "results" / "tta.json",
        help="restore: the stored report whose link rates, learning rates and curves go back into --work",
    )
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    phases = ["calibrate", "tune", "curves", "steptime", "validate", "report"] if args.phase == "all" else [args.phase]
    for phase in phases:
        print(f"== {phase}", flush=True)
        globals()[phase](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
