"""Convergence of Birder against uncompressed AdamW / SGDM on the recipes' embedded tasks (issue 7).

Runs the two recipes as users run them (``torchrun``, 4 CPU processes as 2 simulated nodes x 2) with the same data,
steps and seeds for every method, then writes curves, a table of final metrics (mean ± std over seeds) and the JSON
of all numbers:

- ``birder-h``: Birder, hierarchical 1-bit all-reduce (``--method hierarchical --num_nodes 2``);
- ``birder-flat``: Birder, flat 1-bit all-gather (``--method allgather``);
- ``adamw`` (both tasks) and ``sgdm`` (ResNet): the uncompressed baselines (DDP fp32 all-reduce);
- ``birder-1p``: one process with ``quantize=False`` and the same global batch, a reference without 1-bit noise;
- ``onebitadam``: 1-bit Adam (Tang et al. 2021, the paper's compressed baseline) with AdamW's learning rate and a
  full-precision warm-up of 20% of the steps (``--freeze_step``), the error-feedback 1-bit phase after it.

    python benchmarks/convergence.py                        # the full run: 3 seeds, 33 runs (33 min, idle machine)
    python benchmarks/convergence.py --seeds 0 --bert_steps 60 --resnet_model resnet10t   # what fits a busy machine
    python benchmarks/convergence.py --plot_only            # redraw from the runs already in --work_dir

Runs are resumable: a run whose ``all_results.json`` exists is read, not run again. Runs go seed by seed, so a
partial benchmark has every method at the seeds it reached. ResNet-50 takes minutes per step on CPU; the full run
uses ResNet-18 (``--resnet_model resnet50`` is the documented default for real hardware).

Learning rates (one per optimizer, the same on every seed): BERT: 4e-3 for Birder (the best of 1e-3 / 2e-3 / 4e-3),
the recipe's 2e-3 for AdamW (better than 4e-3) and 1-bit Adam; ``--bert_lr`` / ``--resnet_lr`` change them.
ResNet: the seed's 0.004 (wd 0.1) for Birder, AdamW and 1-bit Adam; SGDM the standard 0.1, momentum 0.9, wd 5e-4
(the recipe's wd 0.1 is decoupled wd for Birder/AdamW; as coupled L2 in SGD it would cripple the baseline).
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"

# method -> (label, color); baselines grey/blue, Birder oranges
METHOD_STYLE = {
    "adamw": ("AdamW (fp32 all-reduce)", "#4c72b0"),
    "sgdm": ("SGDM (fp32 all-reduce)", "#7f7f7f"),
    "birder-h": ("Birder hierarchical (1-bit)", "#d94801"),
    "birder-flat": ("Birder flat allgather (1-bit)", "#fdae6b"),
    "birder-1p": ("Birder 1 process, quantize=False", "#2ca02c"),
    "onebitadam": ("1-bit Adam (20% warm-up)", "#9467bd"),
}
SHORT = {  # bar-chart tick labels
    "adamw": "AdamW\nfp32",
    "sgdm": "SGDM\nfp32",
    "birder-h": "Birder\nhierarchical",
    "birder-flat": "Birder\nflat",
    "birder-1p": "Birder 1 proc.\nno quantize",
    "onebitadam": "1-bit Adam",
}
BASELINES = ("adamw", "sgdm")
BIRDER_DISTRIBUTED = ("birder-h", "birder-flat")
PRIMARY = {"bert": ("eval_f1", "SQuAD F1"), "resnet": ("val_top1", "top-1 (%)")}


@dataclass
class Config:
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    tasks: list[str] = field(default_factory=lambda: ["bert", "resnet"])
    methods: list[str] = field(default_factory=lambda: list(METHOD_STYLE))
    nproc: int = 4  # processes per distributed run
    num_nodes: int = 2  # simulated nodes for birder-h
    # BERT (tiny, from scratch, embedded SQuAD-format task)
    bert_steps: int = 200
    bert_batch: int = 16  # per process
    # Birder 4e-3: measured best of 1e-3 / 2e-3 / 4e-3 (F1 38.2 / 52.0 / 55.6, seed 0); AdamW keeps the recipe's 2e-3
    # (54.3; 4e-3 gave 53.8); 1-bit Adam takes AdamW's
    bert_lr: dict = field(default_factory=lambda: {"birder": 4e-3, "adamw": 2e-3, "onebitadam": 2e-3})
    bert_logging_steps: int = 10
    bert_extra: list[str] = field(default_factory=list)
    # ResNet (timm, embedded digits 32x32)
    resnet_model: str = "resnet18"
    resnet_epochs: int = 4
    resnet_batch: int = 32  # per process
    resnet_lr: dict = field(default_factory=lambda: {"birder": 4e-3, "adamw": 4e-3, "sgdm": 0.1, "onebitadam": 4e-3})
    resnet_wd: dict = field(default_factory=lambda: {"birder": 0.1, "adamw": 0.1, "sgdm": 5e-4, "onebitadam": 0.1})
    resnet_logging_steps: int = 4
    onebit_warmup: float = 0.2  # 1-bit Adam's full-precision share of the steps
    resnet_extra: list[str] = field(default_factory=list)


@dataclass
class Run:
    task: str
    method: str
    seed: int
    nproc: int
    args: list[str]

    @property
    def name(self) -> str:
        return f"{self.task}-{self.method}-seed{self.seed}"


def _task_methods(task: str, methods: list[str]) -> list[str]:
    allowed = {"bert": ("birder-h", "birder-flat", "adamw", "birder-1p", "onebitadam")}.get(task, tuple(METHOD_STYLE))
    return [m for m in methods if m in allowed]


DIGITS_TRAIN = 1437  # about: images in the embedded digits' train split (recipes/embedded_data.py, 80% of 1797)


def total_steps(task: str, cfg: Config) -> int:
    if task == "bert":
        return cfg.bert_steps
    return cfg.resnet_epochs * (DIGITS_TRAIN // cfg.resnet_batch // cfg.nproc)  # drop_last batches, sharded


def _method_args(task: str, method: str, cfg: Config) -> tuple[int, list[str]]:
    """(processes, recipe arguments) of one method; everything else is the same for all methods of a task."""
    nproc = 1 if method == "birder-1p" else cfg.nproc
    opt = "birder" if method.startswith("birder") else method
    comm = {"birder-h": ["--method", "hierarchical", "--num_nodes", str(cfg.num_nodes)]}
    comm["birder-flat"] = ["--method", "allgather"]
    args = ["--optimizer", opt, *comm.get(method, [])]
    if method == "onebitadam":
        args += ["--freeze_step", str(max(1, round(cfg.onebit_warmup * total_steps(task, cfg))))]
    if task == "bert":
        batch = cfg.bert_batch * (cfg.nproc if nproc == 1 else 1)  # same global batch in one process
        args += ["--learning_rate", str(cfg.bert_lr[opt]), "--per_device_train_batch_size", str(batch)]
        args += ["--warmup_steps", "0"]  # the stored runs' schedule (the recipe's default before it became 20%)
        if method == "birder-1p":
            args += ["--quantize", "False"]
    else:
        batch = cfg.resnet_batch * (cfg.nproc if nproc == 1 else 1)
        args += [
            "--lr",
            str(cfg.resnet_lr[opt]),
            "--weight_decay",
            str(cfg.resnet_wd[opt]),
            "--batch_size",
            str(batch),
            "--logging_steps",
            str(cfg.resnet_logging_steps),
        ]
        if method == "birder-1p":
            args += ["--quantize", "False"]
    return nproc, args


def plan_runs(cfg: Config) -> list[Run]:
    """All runs, seed-major (a partial benchmark has every method at the seeds it reached)."""
    runs = []
    for seed in cfg.seeds:
        for task in cfg.tasks:
            for method in _task_methods(task, cfg.methods):
                nproc, args = _method_args(task, method, cfg)
                if task == "bert":
                    args += ["--max_steps", str(cfg.bert_steps), "--logging_steps", str(cfg.bert_logging_steps)]
                    args += ["--seed", str(seed), *cfg.bert_extra]
                else:
                    args += ["--model", cfg.resnet_model, "--epochs", str(cfg.resnet_epochs), "--save_every_epochs"]
                    args += ["0", "--seed", str(seed), *cfg.resnet_extra]
                runs.append(Run(task, method, seed, nproc, args))
    return runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(run: Run, output_dir: Path) -> list[str]:
    """The command line of one run (``torchrun`` for several processes, plain ``python`` for one)."""
    script = RECIPES / ("bert_base.py" if run.task == "bert" else "resnet50.py")
    args = [*run.args, "--output_dir", str(output_dir)]
    if run.nproc == 1:
        return [sys.executable, str(script), *args]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(run.nproc)]
    launcher += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    return [*launcher, str(script), *args]


def run_one(run: Run, work_dir: Path, timeout: float = 3600) -> Path:
    """Run (or skip, when its all_results.json exists) one run; returns its output folder."""
    out = Path(work_dir) / run.name
    if (out / "all_results.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    with open(out / "run.log", "w") as log:
        res = subprocess.run(
            command(run, out), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
        )
    if res.returncode != 0 or not (out / "all_results.json").exists():
        tail = (out / "run.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{run.name} failed (exit {res.returncode}); log {out / 'run.log'}:\n{tail}")
    return out


def load_run(run: Run, out: Path) -> dict:
    """Curves and final metrics of a finished run: loss over steps, validation metric over steps (ResNet)."""
    with open(out / "all_results.json") as f:
        res = json.load(f)
    record = {"task": run.task, "method": run.method, "seed": run.seed, "nproc": run.nproc, "args": run.args}
    if run.task == "bert":
        with open(out / "trainer_state.json") as f:
            history = json.load(f)["log_history"]
        logs = [h for h in history if "loss" in h]
        record["loss_steps"] = [h["step"] for h in logs]
        record["loss"] = [h["loss"] for h in logs]
        record["val_steps"], record["val"] = [], []  # the recipe computes EM/F1 at the end only
        record["final"] = {"eval_f1": res["eval_f1"], "eval_exact_match": res["eval_exact_match"]}
        record["train_runtime_s"] = res.get("train_runtime")
    else:
        epochs = res["epochs"]
        logged = res.get("steps") or epochs  # rank 0's loss every --logging_steps steps (older runs: per epoch)
        record["loss_steps"] = [e["step"] for e in logged]
        record["loss"] = [e["train_loss"] for e in logged]
        record["val_steps"] = [e["step"] for e in epochs]
        record["val"] = [e["val_top1"] for e in epochs]
        record["final"] = {"val_top1": res["final_val_top1"], "train_loss": res["final_train_loss"]}
    last = res["epochs"][-1] if run.task == "resnet" else res  # ResNet: the hook's counters per epoch
    for key in ("comm/compression_ratio", "comm/inter_node_bytes", "comm/intra_node_bytes"):
        if key in last:
            record[key] = last[key]
    return record


def loss_ratio(record: dict) -> float:
    """Last logged training loss over the first: how far the loss fell (< 1 when it falls)."""
    return record["loss"][-1] / record["loss"][0]


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize(records: list[dict]) -> dict:
    """Per task and method: final metrics mean/std over seeds; the target check against the best baseline."""
    summary = {}
    for task in dict.fromkeys(r["task"] for r in records):
        rows = {}
        for method in dict.fromkeys(r["method"] for r in records if r["task"] == task):
            recs = [r for r in records if r["task"] == task and r["method"] == method]
            row = {"seeds": [r["seed"] for r in recs]}
            for key in recs[0]["final"]:
                row[key] = dict(zip(("mean", "std"), _mean_std([r["final"][key] for r in recs])))
            row["loss_ratio"] = dict(zip(("mean", "std"), _mean_std([loss_ratio(r) for r in recs])))
            rows[method] = row
        key = PRIMARY[task][0]
        base = [m for m in BASELINES if m in rows]
        target = {}
        if base:
            best = max(base, key=lambda m: rows[m][key]["mean"])
            for method in [m for m in BIRDER_DISTRIBUTED if m in rows]:
                gap = rows[best][key]["mean"] - rows[method][key]["mean"]  # > 0: Birder below the baseline
                tol = max(1.0, rows[best][key]["std"], rows[method][key]["std"])
                target[method] = {"best_baseline": best, "gap": gap, "tolerance": tol, "met": gap <= tol}
        summary[task] = {"metric": key, "methods": rows, "target": target}
    return summary


def table_markdown(summary: dict) -> str:
    lines = []
    for task, s in summary.items():
        keys = list(next(iter(s["methods"].values())).keys() - {"seeds", "loss_ratio"})
        keys.sort(key=lambda k: k != s["metric"])
        head = ["method", "seeds", *keys, "loss last/first"]
        lines += [f"**{task}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for method, row in s["methods"].items():
            cells = [METHOD_STYLE[method][0], str(len(row["seeds"]))]
            cells += [f"{row[k]['mean']:.2f} ± {row[k]['std']:.2f}" for k in keys]
            cells.append(f"{row['loss_ratio']['mean']:.3f} ± {row['loss_ratio']['std']:.3f}")
            lines.append("| " + " | ".join(cells) + " |")
        for method, t in s["target"].items():
            verdict = "met" if t["met"] else "missed"
            lines.append(
                f"\n{METHOD_STYLE[method][0]}: {s['metric']} {-t['gap']:+.2f} against {t['best_baseline']} "
                f"(tolerance {t['tolerance']:.2f}): target {verdict}."
            )
        lines.append("")
    return "\n".join(lines)


def _band(records: list[dict], xkey: str, ykey: str):
    """Mean, min and max over seeds at the x positions all seeds share."""
    xs = sorted(set.intersection(*(set(r[xkey]) for r in records)))
    ys = [[r[ykey][r[xkey].index(x)] for r in records] for x in xs]
    return xs, [statistics.fmean(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def plot(records: list[dict], summary: dict, results_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for task, s in summary.items():
        recs = [r for r in records if r["task"] == task]
        has_val = any(r["val"] for r in recs)
        fig, axes = plt.subplots(1, 3 if has_val else 2, figsize=(15 if has_val else 10.5, 4.2))
        methods = list(s["methods"])
        for method in methods:
            mrecs = [r for r in recs if r["method"] == method]
            label, color = METHOD_STYLE[method]
            panels = [(axes[0], "loss_steps", "loss")] + ([(axes[1], "val_steps", "val")] if has_val else [])
            for ax, xkey, ykey in panels:
                xs, mean, lo, hi = _band(mrecs, xkey, ykey)
                ax.plot(xs, mean, marker="o", ms=3, color=color, label=f"{label}, n={len(mrecs)}")
                ax.fill_between(xs, lo, hi, color=color, alpha=0.2)
        axes[0].set(xlabel="optimizer step", ylabel="training loss", title=f"{task}: training loss (mean, min-max)")
        axes[0].legend(fontsize=7)
        if has_val:
            axes[1].set(xlabel="optimizer step", ylabel=PRIMARY[task][1], title=f"{task}: validation (mean, min-max)")
        bar = axes[-1]
        key = s["metric"]
        means = [s["methods"][m][key]["mean"] for m in methods]
        stds = [s["methods"][m][key]["std"] for m in methods]
        bar.bar(range(len(methods)), means, yerr=stds, capsize=4, color=[METHOD_STYLE[m][1] for m in methods])
        for i, (m, sd) in enumerate(zip(means, stds)):
            bar.text(i, m + sd, f"{m:.1f}", ha="center", va="bottom", fontsize=8)
        bar.set_xticks(range(len(methods)), [SHORT[m] for m in methods], fontsize=8)
        bar.set(ylabel=PRIMARY[task][1], title=f"{task}: final {PRIMARY[task][1]} (mean ± std)")
        fig.tight_layout()
        path = Path(results_dir) / f"convergence_{task}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def run_benchmark(cfg: Config, work_dir: Path, results_dir: Path | None, plot_only: bool = False, argv=None) -> dict:
    """Run (or resume) every run of ``cfg``, then write the JSON, table and plots into ``results_dir`` (``argv``: the
    command line's arguments, recorded)."""
    runs = plan_runs(cfg)
    records, failures = [], []
    start = time.time()
    for i, run in enumerate(runs, 1):
        out = Path(work_dir) / run.name
        if plot_only and not (out / "all_results.json").exists():
            continue
        t0 = time.time()
        cached = (out / "all_results.json").exists()
        try:
            out = run_one(run, work_dir)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:  # report, and go on with the other runs
            failures.append(run.name)
            print(f"[{i}/{len(runs)}] {run.name}: FAILED\n{exc}", flush=True)
            continue
        rec = load_run(run, out)
        rec["wall_s"] = None if cached else round(time.time() - t0, 1)
        records.append(rec)
        metric = ", ".join(f"{k} {v:.2f}" for k, v in rec["final"].items())
        took = "cached" if cached else f"{time.time() - t0:.0f} s"
        print(
            f"[{i}/{len(runs)}] {run.name}: {metric}, loss {rec['loss'][0]:.3f} -> {rec['loss'][-1]:.3f} ({took}; "
            f"{(time.time() - start) / 60:.1f} min in all)",
            flush=True,
        )
    summary = summarize(records)
    result = {"config": asdict(cfg), "summary": summary, "runs": records, "failed": failures}
    result.update(provenance(__file__, argv))
    if results_dir is not None:
        results_dir = Path(results_dir)
        results_dir.mkdir(parents=True, exist_ok=True)
        with open(results_dir / "convergence_results.json", "w") as f:
            json.dump(result, f, indent=1)
        (results_dir / "convergence_table.md").write_text(table_markdown(summary) + "\n")
        plot(records, summary, results_dir)
    print(table_markdown(summary), flush=True)
    return result


def parse_args(argv=None) -> tuple[Config, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = Config()
    p.add_argument("--seeds", type=int, nargs="+", default=d.seeds)
    p.add_argument("--tasks", nargs="+", default=d.tasks, choices=["bert", "resnet"])
    p.add_argument("--methods", nargs="+", default=d.methods, choices=list(METHOD_STYLE))
    p.add_argument("--nproc", type=int, default=d.nproc, help="Processes per distributed run.")
    p.add_argument("--num_nodes", type=int, default=d.num_nodes, help="Simulated nodes for birder-h.")
    p.add_argument("--bert_steps", type=int, default=d.bert_steps)
    p.add_argument("--bert_logging_steps", type=int, default=d.bert_logging_steps)
    p.add_argument("--resnet_model", default=d.resnet_model, help="timm model (resnet50 on real hardware).")
    p.add_argument("--resnet_epochs", type=int, default=d.resnet_epochs)
    p.add_argument("--bert_lr", nargs="+", default=[], metavar="OPT=LR", help="e.g. birder=3e-3 (per optimizer)")
    p.add_argument("--resnet_lr", nargs="+", default=[], metavar="OPT=LR", help="e.g. birder=8e-3 sgdm=0.1")
    p.add_argument("--beta", type=float, default=None, help="Birder's beta on both tasks (default: the recipes')")
    p.add_argument("--work_dir", type=Path, default=ROOT / "outputs" / "convergence")
    p.add_argument("--results_dir", type=Path, default=ROOT / "docs" / "results")
    p.add_argument("--plot_only", action="store_true", help="Only collect the finished runs and redraw.")
    a = p.parse_args(argv)
    cfg = Config(
        seeds=a.seeds,
        tasks=a.tasks,
        methods=a.methods,
        nproc=a.nproc,
        num_nodes=a.num_nodes,
        bert_steps=a.bert_steps,
        bert_logging_steps=a.bert_logging_steps,
        resnet_model=a.resnet_model,
        resnet_epochs=a.resnet_epochs,
    )
    for name, items in (("bert_lr", a.bert_lr), ("resnet_lr", a.resnet_lr)):
        for item in items:
            opt, _, value = item.partition("=")
            if opt not in getattr(cfg, name) or not value:
                raise SystemExit(f"--{name} expects OPT=LR with OPT in {sorted(getattr(cfg, name))}, got {item!r}")
            getattr(cfg, name)[opt] = float(value)
    if a.beta is not None:
        cfg.bert_extra += ["--beta", str(a.beta)]
        cfg.resnet_extra += ["--beta", str(a.beta)]
    return cfg, a


def main(argv=None) -> dict:
    cfg, a = parse_args(argv)
    if cfg.nproc % cfg.num_nodes:
        raise ValueError(f"--num_nodes {cfg.num_nodes} must divide --nproc {cfg.nproc}.")
    return run_benchmark(cfg, a.work_dir, a.results_dir, plot_only=a.plot_only, argv=argv)


if __name__ == "__main__":
    main()
