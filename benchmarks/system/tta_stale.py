"""Stale-direction drift (issue 25): Birder hierarchical's quality per step with each remedy, on the TTA tasks.

The question: a coordinate that stops receiving gradient keeps ``u = m / b`` (m and b decay alike), so the paper's
literal update moves it by lr every step in its last direction. Which remedy gives the best median and worst seed?

- ``literal``: the paper's update (``Birder(..., stale="keep")``; ``lazy=False`` in trees from before ``stale``);
- ``amsgrad``: ``b`` is a running max, so a stale ``u`` decays (``stale="keep", amsgrad=True``);
- ``lazy``: a coordinate whose gradient is exactly zero this step does not vote (``stale="lazy"``);
- ``both``: ``stale="lazy", amsgrad=True``.

Each run is ``tta.py``'s quality-per-step run (``_tta_worker.py``, 4 ranks as 2 nodes x 2 on loopback, the task's
stored tuned lr from ``docs/results/tta.json``), with the variant's options::

    python benchmarks/system/tta_stale.py run --tasks qa --variants lazy literal amsgrad --seeds 0 1 2 3 4
    python benchmarks/system/tta_stale.py report --tasks qa lm    # docs/results/tta_stale.{json,png}

Runs are resumable (a complete JSON-lines file is read, not run again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent))  # benchmarks/provenance.py

import tta  # noqa: E402
from provenance import provenance  # noqa: E402

VARIANTS = {
    "literal": {"lazy": False, "amsgrad": False},
    "amsgrad": {"lazy": False, "amsgrad": True},
    "lazy": {"lazy": True, "amsgrad": False},
    "both": {"lazy": True, "amsgrad": True},
}
COLORS = {"literal": "#d94801", "amsgrad": "#6a51a3", "lazy": "#238b45", "both": "#2171b5"}
# the protocol's steps and batch per process (docs/BENCHMARKS.md, "Time to accuracy")
SETTING = {"qa": {"steps": 600, "batch": 8}, "image": {"steps": 250, "batch": 8}, "lm": {"steps": 300, "batch": 4}}


def _options(variant: str) -> dict:
    import inspect

    from birder_hf import Birder

    opts = dict(VARIANTS[variant])
    params = inspect.signature(Birder).parameters
    if "stale" in params:  # lazy= is the deprecated name of stale="lazy" / "keep"
        opts["stale"] = "lazy" if opts.pop("lazy") else "keep"
    elif "lazy" not in params:  # a tree from before either option: literal was the only way
        if opts.pop("lazy"):
            raise SystemExit(f"{variant} needs Birder(lazy=...); this tree's Birder has no such option")
    return opts


def _lr(task: str) -> float:
    return json.loads((tta.ROOT / "docs" / "results" / "tta.json").read_text())["tuned"][task]["birder-h"]["lr"]


def _path(args, task, variant, seed, lr=None) -> Path:
    at = "" if lr is None or lr == _lr(task) else f"-lr{lr:g}"  # the tuned lr's runs carry no suffix
    return args.work / f"{task}-{variant}{at}-seed{seed}.jsonl"


def _stored_literal(task: str, lr: float) -> tuple[list[int], dict[int, list[float]]]:
    """Curves of the literal update that other benchmarks stored: the TTA table's runs (tuned lr, seeds 0-2) and,
    for QA at 2e-3, ``tta_lr_check.json`` (seeds 0-2)."""
    results = tta.ROOT / "docs" / "results"
    if lr == _lr(task):
        tta_json = json.loads((results / "tta.json").read_text())
        stored = tta_json["tasks"][task]["methods"]["birder-h"]
        return stored["steps"], dict(zip(tta_json["config"]["seeds"], stored["per_seed"]))
    check = json.loads((results / "tta_lr_check.json").read_text())
    if task == "qa" and lr == 0.002:
        runs = check["runs"]
        return runs["seed0"]["steps"], {int(k[4:]): v["f1"] for k, v in runs.items()}
    return [], {}


def run(args) -> None:
    for task in args.tasks:
        for seed in args.seeds:
            for variant in args.variants:
                out = _path(args, task, variant, seed, args.lr)
                out.parent.mkdir(parents=True, exist_ok=True)
                opts = _options(variant)
                ns = argparse.Namespace(steps=SETTING[task]["steps"], batch=SETTING[task]["batch"], nproc=4,
                                        work=args.work)  # fmt: skip
                extra = ["--birder-options", json.dumps(opts), "--tag", json.dumps({"variant": variant})]
                tta.run_local(task, "birder-h", args.lr or _lr(task), seed, ns, out, extra=extra)


def report(args) -> dict:
    ref = json.loads((tta.ROOT / "docs" / "results" / "tta.json").read_text())["tasks"]
    result = {**provenance(__file__), "tasks": {}}
    for task, lr in [(name, lr) for name in args.tasks for lr in [_lr(name), *(args.extra_lr or [])]]:
        key, higher, label = tta.PRIMARY[task]
        t = {"metric": key, "label": label, "target": ref[task]["target"], "lr": lr, **SETTING[task],
             "variants": {}}  # fmt: skip
        for variant in args.variants:
            runs = {s: tta.read(_path(args, task, variant, s, lr)) for s in args.seeds}
            runs = {s: r for s, r in runs.items() if tta._complete(_path(args, task, variant, s, lr))}
            per_seed = {s: [e[key] for e in r if e.get("kind") == "eval"] for s, r in runs.items()}
            steps = [e["step"] for e in next(iter(runs.values())) if e.get("kind") == "eval"] if runs else None
            source = {s: "this benchmark" for s in per_seed}
            if variant == "literal":  # runs of the literal update stored by other benchmarks, where not rerun
                stored_steps, stored = _stored_literal(task, lr)
                for s, curve in stored.items():
                    if s in args.seeds and s not in per_seed and (steps is None or steps == stored_steps):
                        per_seed[s], steps = curve, stored_steps
                        source[s] = "docs/results/tta.json" if lr == _lr(task) else "docs/results/tta_lr_check.json"
            if not per_seed:
                continue
            per_seed = dict(sorted(per_seed.items()))
            final = {s: v[-1] for s, v in per_seed.items()}
            worst = (min if higher else max)(final.values())
            reached = {s: next((st for st, v in zip(steps, c) if (v >= t["target"] if higher else v <= t["target"])),
                               None) for s, c in per_seed.items()}  # fmt: skip
            t["variants"][variant] = {"options": VARIANTS[variant], "seeds": sorted(per_seed), "source": source,
                                      "steps": steps,
                                      "per_seed": per_seed, "final": final,
                                      "median_final": statistics.median(final.values()), "worst_final": worst,
                                      "first_step_at_target": reached}  # fmt: skip
        if t["variants"]:
            result["tasks"][task if lr == _lr(task) else f"{task}@{lr:g}"] = t
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "tta_stale.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    if not args.no_plots:
        plot(result, args.results / "tta_stale.png")
    return result


def table(result: dict) -> str:
    lines = []
    for task, t in result["tasks"].items():
        lines.append(f"**{task}** ({t['label']}, lr {t['lr']:g}, {t['steps']} steps; target {t['target']:.2f})\n")
        lines.append("| variant | seeds | final per seed | median | worst | seeds at target (first step) |")
        lines.append("|---|---|---|---:|---:|---|")
        for v, r in t["variants"].items():
            per = ", ".join(f"{s}: {x:.1f}" for s, x in r["final"].items())
            hit = [f"{s}@{st}" for s, st in r["first_step_at_target"].items() if st is not None]
            lines.append(f"| {v} | {len(r['seeds'])} | {per} | {r['median_final']:.1f} | {r['worst_final']:.1f} | "
                         f"{len(hit)} of {len(r['seeds'])}: {', '.join(hit)} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(result["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        t = result["tasks"][task]
        for v, r in t["variants"].items():
            curves = list(r["per_seed"].values())
            med = [statistics.median(c[i] for c in curves) for i in range(len(r["steps"]))]
            ax.plot(r["steps"], med, color=COLORS[v], label=f"{v} (median of {len(curves)})")
            for c in curves:
                ax.plot(r["steps"], c, color=COLORS[v], alpha=0.25, lw=0.8)
        ax.axhline(t["target"], color="grey", ls="--", lw=0.8, label="target (95% of fp32's final)")
        title = f"{tta.TITLES[task.split('@')[0]]}: Birder hierarchical, lr {t['lr']:g}"
        ax.set(title=title, xlabel="step", ylabel=t["label"])
        if not tta.PRIMARY[task.split("@")[0]][1]:
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=("run", "report"))
    ap.add_argument("--tasks", nargs="+", default=["qa", "lm"], choices=tuple(tta.PRIMARY))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=tuple(VARIANTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--work", type=Path, default=tta.ROOT / "outputs" / "tta_stale")
    ap.add_argument("--results", type=Path, default=tta.ROOT / "docs" / "results")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--lr", type=float, default=None, help="run: this lr instead of the tuned one (tta.json)")
    ap.add_argument("--extra-lr", type=float, nargs="*", help="report: these learning rates too")
    args = ap.parse_args(argv)
    globals()[args.phase](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
