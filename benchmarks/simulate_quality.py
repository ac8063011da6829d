"""Quality per step at the paper's worker counts (issue 25, item 3), in one process.

Birder with n = k x L simulated workers (``simulate_workers.SimulatedWorkers``: the library's encode, votes and mean;
bit-equal to a real run at 2 x 2) against AdamW (``adamw``) or SGD with momentum (``sgdm``, the image task's), on a
time-to-accuracy task (``system/_tta_worker.py``'s model, data and schedule: linear warm-up over 5% of the steps,
``--warmup`` to change it, then linear decay), at the same global batch: worker r of n takes elements
``[r b, (r + 1) b)`` of the global batch of step s (b = global / n), so every n sees the same samples on every step.
The baseline takes the whole global batch in one backward (DDP fp32's average of equal shards).

    python benchmarks/simulate_quality.py --task qa --workers 2x2 2x4 4x8 adamw --seeds 0 1 2 --steps 600
    python benchmarks/simulate_quality.py --task qa --report      # docs/results/simulate_quality.json

Each run appends one JSON line per evaluation to ``--work``/{task}-{workers}-seed{s}.jsonl (resumable: a complete
run is read, not run again).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "system"))

from provenance import provenance  # noqa: E402
from simulate_workers import SimulatedWorkers  # noqa: E402

PRIMARY = {"qa": ("f1", True), "image": ("top1", True), "lm": ("perplexity", False)}
GLOBAL_BATCH = {"qa": 32, "image": 32, "lm": 16}  # the protocol's: 4 ranks x 8 (qa, image) or x 4 (lm)
WARMUP = 0.05  # the protocol's linear warm-up, as a fraction of the steps
LR = {
    "birder": {"qa": 4e-3, "image": 2e-3, "lm": 1e-3},
    "adamw": {"qa": 2e-3, "lm": 5e-4},
    "sgdm": {"image": 0.1},
}  # docs/results/tta.json
BASELINES = {"adamw": "AdamW", "sgdm": "SGDM"}  # one process, the whole global batch (DDP fp32's optimizer)


def _run(task_name: str, workers: str, seed: int, args, out: Path) -> None:
    from _tta_worker import build_task, lr_lambda

    if finished_evals(out) is not None:
        return
    out.unlink(missing_ok=True)
    total = _global_batch(args, task_name)
    nodes, local = (1, 1) if workers in BASELINES else map(int, workers.split("x"))
    n = nodes * local
    if total % n:
        raise SystemExit(f"{workers}: {n} workers do not split the global batch of {total}")
    with one_process_group():
        ns = argparse.Namespace(seed=seed, batch=total // n, qa_train=2400, qa_eval=240)
        task = build_task(task_name, ns, 0, n, args.work / "data")
        model, params = task.model, list(task.model.parameters())
        if workers in BASELINES:
            opt = _baseline(workers, params, _lr(args, task_name, workers))
            lead = opt
        else:
            wd = 0.1 if task_name == "image" else 0.01
            options = json.loads(args.options)
            sim = SimulatedWorkers(params, nodes, local, lr=_lr(args, task_name, workers), weight_decay=wd, seed=seed,
                                   **options)  # fmt: skip
            lead = sim.optimizers[0]
        sched = torch.optim.lr_scheduler.LambdaLR(lead, lr_lambda(args.steps, _warmup(args)))
        base = {"task": task_name, "workers": workers, "n": n, "seed": seed, "steps": args.steps,
                "global_batch": total, "lr": _lr(args, task_name, workers), "warmup": _warmup(args),
                "options": json.loads(args.options)}  # fmt: skip

        def emit(rec):
            with open(out, "a") as f:
                f.write(json.dumps({**base, **rec}) + "\n")

        def evaluate(step, losses):
            model.eval()
            emit({"kind": "eval", "step": step, "train_loss": sum(losses) / max(1, len(losses)),
                  **task.evaluate(model)})  # fmt: skip
            model.train()

        evaluate(0, [])
        losses, t0 = [], time.perf_counter()
        for step in range(1, args.steps + 1):
            grads, step_loss = worker_grads(task, params, n, step)
            if workers in BASELINES:
                opt.step()
            else:
                sim.step(grads)
            sched.step()
            losses.append(step_loss)
            if step % args.eval_every == 0 or step == args.steps:
                evaluate(step, losses)
                losses = []
        emit({"kind": "done", "seconds": time.perf_counter() - t0})


@contextlib.contextmanager
def one_process_group():
    """A gloo process group of this one process (the library's collectives need one), destroyed on exit."""
    import torch.distributed as dist

    init = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{init.name}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        Path(init.name).unlink(missing_ok=True)


def worker_grads(task, params: list, n: int, step: int) -> tuple[list[list[torch.Tensor]], float]:
    """Each of ``n`` workers' gradients (zeros for a parameter without one) on its shard of step ``step``'s global
    batch, worker r as ``task.rank = r``, and their mean loss."""
    grads, step_loss = [], 0.0
    for r in range(n):
        task.rank = r  # worker r's shard of the global batch
        task.model.zero_grad(set_to_none=True)
        loss = task.loss(task.model, task.batch(step))
        loss.backward()
        step_loss += loss.item() / n
        grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params])
    return grads, step_loss


def _global_batch(args, task: str) -> int:
    return getattr(args, "global_batch", None) or GLOBAL_BATCH[task]


def _lr(args, task: str, workers: str) -> float:
    return args.lr if args.lr is not None else LR[workers if workers in BASELINES else "birder"][task]


def _baseline(name: str, params, lr: float) -> torch.optim.Optimizer:
    """The TTA table's DDP fp32 optimizer: AdamW (qa, lm) or SGD with momentum 0.9 (image)."""
    if name == "sgdm":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def _warmup(args) -> float:
    return getattr(args, "warmup", None) or WARMUP


def _warmup_tag(args) -> str:
    """A run file's warm-up part: empty at the protocol's default."""
    return "" if _warmup(args) == WARMUP else f"-wu{_warmup(args):g}"


def _path(args, workers: str, seed: int) -> Path:
    """One run's file: task, workers, learning rate, Birder options (a tag), seed."""
    tag = "".join(f"-{k}{v}" for k, v in sorted(json.loads(args.options).items())) if workers not in BASELINES else ""
    if _global_batch(args, args.task) != GLOBAL_BATCH[args.task]:
        tag += f"-gb{_global_batch(args, args.task)}"
    tag += _warmup_tag(args)
    return args.work / f"{args.task}-{workers}-lr{_lr(args, args.task, workers):g}{tag}-seed{seed}.jsonl"


def finished_evals(path: Path) -> list[dict] | None:
    """A run file's evaluation records, or ``None`` if the run is absent or did not finish."""
    recs = [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []
    return [r for r in recs if r["kind"] == "eval"] if any(r["kind"] == "done" for r in recs) else None


def curve(evals: list[dict], key: str) -> dict:
    """``{"steps": [...], key: [...]}``, the form the reports store and plot."""
    return {"steps": [e["step"] for e in evals], key: [e[key] for e in evals]}


def tta_target(task: str) -> float:
    """The time-to-accuracy target: 95% of DDP fp32's median final at the protocol's batch (docs/results/tta.json)."""
    return json.loads((ROOT / "docs" / "results" / "tta.json").read_text())["tasks"][task]["target"]


def report(args, argv=None) -> dict:
    """Per worker count: final metric and first step at the target, median and worst seed; a table and a figure."""
    key, higher = PRIMARY[args.task]
    target, gb = tta_target(args.task), _global_batch(args, args.task)
    res = {"task": args.task, "metric": key, "global_batch": gb, "target": target, "warmup": _warmup(args),
           "options": json.loads(args.options),
           "lr": {w: _lr(args, args.task, w) for w in args.workers}, "runs": {}}  # fmt: skip
    reached = (lambda v: v >= target) if higher else (lambda v: v <= target)  # noqa: E731
    for workers in args.workers:
        finals, curves, to_target = {}, {}, {}
        for seed in args.seeds:
            path = _path(args, workers, seed)
            ev = finished_evals(path)
            if ev is None:
                continue
            curves[seed] = curve(ev, key)
            finals[seed] = ev[-1][key]
            to_target[seed] = next((e["step"] for e in ev if reached(e[key])), None)
        if finals:
            steps = sorted(x if x is not None else float("inf") for x in to_target.values())
            n = 1 if workers in BASELINES else math.prod(map(int, workers.split("x")))
            res["runs"][workers] = {"n": n, "batch_per_worker": gb // n,
                                    "final": finals, "median": statistics.median(finals.values()),
                                    "worst": (min if higher else max)(finals.values()), "step_to_target": to_target,
                                    "step_to_target_median": statistics.median(steps),
                                    "step_to_target_worst": steps[-1], "curves": curves}  # fmt: skip
    args.results.mkdir(parents=True, exist_ok=True)
    name = f"simulate_quality_{args.task}" + (f"_gb{gb}" if gb != GLOBAL_BATCH[args.task] else "") + args.tag
    _write_table_and_figure(res, args.results / name, args)
    res.update(provenance(__file__, argv))
    (args.results / f"{name}.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    for w, r in res["runs"].items():
        print(f"{w}: median {r['median']:.2f}, worst {r['worst']:.2f}, per seed {r['final']}")
    return res


def write_results(stem: Path, data: dict, table_lines: list[str]) -> str:
    """``{stem}.json`` (the numbers) and ``{stem}.md`` (the table made of them); returns the table."""
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    table = "\n".join(table_lines) + "\n"
    Path(f"{stem}.md").write_text(table)
    return table


def plot_seed_bands(rows: list[tuple[str, list[dict]]], key: str, target: float, title: str, path: Path) -> None:
    """One line per row (label, its seeds' curves ``{"steps": [...], key: [...]}``): the median over the seeds, with
    their range shaded; the target dashed. Also ``lr_protocol.py``'s figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, curves in rows:
        xs = curves[0]["steps"]
        ys = [[c[key][i] for c in curves] for i in range(len(xs))]
        line = ax.plot(xs, [statistics.median(y) for y in ys], label=label)[0]
        ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.15)
    ax.axhline(target, color="k", ls="--", lw=0.8, label="target")
    if key == "perplexity":  # from ~4000 at step 0 to ~100: a linear axis flattens every difference that matters
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write_table_and_figure(res: dict, stem: Path, args) -> None:
    key, gb = res["metric"], res["global_batch"]
    shown = lambda x: "not reached" if x == float("inf") else f"{x:g}"  # noqa: E731
    lines = [
        f"**{res['task']}** ({key}; global batch {gb} on every row; target {res['target']:.2f}; seeds "
        f"{', '.join(map(str, args.seeds))}; {args.steps} steps, warm-up {res['warmup']:.0%})",
        "",
        f"<!-- numbers: docs/results/{stem.name}.json -->",
        f"| optimizer | workers n | batch per worker | lr | final {key}: median / worst | steps to target: median / "
        "worst |",
        "|---|---|---|---|---|---|",
    ]
    bands = []
    for workers, r in res["runs"].items():
        label = f"{BASELINES[workers]} (one process)" if workers in BASELINES else f"Birder {workers}"
        lines.append(
            f"| {label} | {r['n']} | {gb // r['n']} | {res['lr'][workers]:g} | {r['median']:.1f} / {r['worst']:.1f} | "
            f"{shown(r['step_to_target_median'])} / {shown(r['step_to_target_worst'])} |"
        )
        bands.append((f"{label}, n = {r['n']}", list(r["curves"].values())))
    title = f"{res['task']}: n simulated workers at global batch {gb}, median and range over seeds"
    plot_seed_bands(bands, key, res["target"], title, Path(f"{stem}.png"))
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=tuple(PRIMARY), default="qa")
    ap.add_argument("--workers", nargs="+", default=["2x2", "2x4", "4x8", "adamw"],
                    help="KxL nodes x ranks, or adamw / sgdm")  # fmt: skip
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per step over all workers (default: the task's, GLOBAL_BATCH; 64 allows n = 64)",
    )
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the task's tuned one, LR)")
    ap.add_argument("--warmup", type=float, default=None, help=f"warm-up fraction of the steps (default {WARMUP})")
    ap.add_argument("--options", default="{}", help='Birder keyword arguments as JSON, e.g. \'{"stale": "keep"}\'')
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--work", type=Path, default=ROOT / "outputs" / "simulate_quality")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--tag", default="", help="appended to the report's file names (e.g. _lr4.7e-3)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.report:
        report(args, argv)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for workers in args.workers:
            _run(args.task, workers, seed, args, _path(args, workers, seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
