"""Learning rates that hold on seeds nobody tuned on (issue 25, item 2), in one process.

Protocol: each method's peak learning rate is chosen on the tuning seeds (0-2) by the median final metric; a value
with a diverged seed (non-finite, or worse than the untrained model) is disqualified. The chosen value is then run
on held-out seeds (3-7) that no choice saw, and the report gives the median *and the worst* held-out seed, and the
step at which each seed first reaches the time-to-accuracy target (95% of DDP fp32's median final, from
``docs/results/tta.json``).

Runs use ``simulate_quality.py``'s one-process workers (bit-equal to a real 2 x 2 DDP run with the hook,
``tests/test_simulate_workers.py``), the TTA tasks' model, data and schedule, and the same global batch.

    python benchmarks/lr_protocol.py --task qa --method 2x2 --grid 1e-3 2e-3 4e-3
    python benchmarks/lr_protocol.py --task qa --method 2x2 --grid 1e-3 2e-3 4e-3 --options '{"stale": "keep"}'
    python benchmarks/lr_protocol.py --task qa --method adamw --grid 1e-3 2e-3 4e-3
    python benchmarks/lr_protocol.py --task qa --report      # docs/results/lr_protocol_qa.{md,png} from the .json

Resumable: a finished run is read from ``--work``, not run again.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import simulate_quality as sq  # noqa: E402

TUNE, HELD_OUT = (0, 1, 2), (3, 4, 5, 6, 7)


def _args(task, method, lr, options, work, steps, eval_every, warmup=None):
    return argparse.Namespace(task=task, workers=[method], lr=lr, options=options, work=work, steps=steps,
                              eval_every=eval_every, warmup=warmup)  # fmt: skip


def _records(args, method, seed):
    return sq.finished_evals(sq._path(args, method, seed))


def summarize(evals: list[dict], key: str, higher: bool, target: float) -> dict:
    """Final metric, first step at the target (None: never), and whether the run diverged."""
    final = evals[-1][key]
    reached = next((e["step"] for e in evals if (e[key] >= target if higher else e[key] <= target)), None)
    diverged = not math.isfinite(final) or (final <= evals[0][key] if higher else final >= evals[0][key])
    return {"final": final, "step_to_target": reached, "diverged": diverged}


def run_method(task, method, grid, options, work, steps, eval_every, warmup=None) -> dict:
    """Tune on TUNE, pick by median (diverged seeds disqualify), run HELD_OUT at the pick. Runs what is missing."""
    key, higher = sq.PRIMARY[task]
    target = sq.tta_target(task)

    def runs(lr, seeds):
        a = _args(task, method, lr, options, work, steps, eval_every, warmup)
        out = {}
        for s in seeds:
            if _records(a, method, s) is None:
                print(f"[lr_protocol] {task} {method} lr={lr:g} {options} seed {s}", flush=True)
                sq._run(task, method, s, a, sq._path(a, method, s))
            evals = _records(a, method, s)
            out[s] = summarize(evals, key, higher, target) | {"curve": sq.curve(evals, key)}
        return out

    tuning = {}
    for lr in grid:
        res = runs(lr, TUNE)
        finals = [r["final"] for r in res.values()]
        ok = not any(r["diverged"] for r in res.values())
        tuning[f"{lr:g}"] = {"median": statistics.median(finals), "disqualified": not ok,
                             "per_seed": {s: r["final"] for s, r in res.items()}}  # fmt: skip
    candidates = {lr: t for lr, t in tuning.items() if not t["disqualified"]}
    if not candidates:
        return {"tuning": tuning, "chosen": None}
    best = (max if higher else min)(candidates, key=lambda lr: candidates[lr]["median"])
    held = runs(float(best), HELD_OUT)
    finals = [r["final"] for r in held.values()]
    steps_to = [r["step_to_target"] for r in held.values()]
    return {
        "tuning": tuning,
        "chosen": float(best),
        "held_out": {
            "per_seed": {s: {k: v for k, v in r.items()} for s, r in held.items()},
            "median": statistics.median(finals),
            "worst": (min if higher else max)(finals),
            "reached": sum(s is not None for s in steps_to),
            "seeds": len(steps_to),
        },
    }


def _s_per_step(task: str, method: str) -> float | None:
    """Seconds per step on the emulated link of the TTA table (docs/results/tta.json): Birder hierarchical's for
    simulated workers, DDP fp32's for AdamW."""
    row = "fp32" if method in sq.BASELINES else "birder-h"
    methods = json.loads((ROOT / "docs" / "results" / "tta.json").read_text())["tasks"][task]["methods"]
    return methods[row]["s_per_step"][1]


def report(task: str, results: Path) -> str:
    """A markdown table and a figure (held-out seeds' curves) from ``lr_protocol_{task}.json``."""
    store = json.loads((results / f"lr_protocol_{task}.json").read_text())
    key, higher = sq.PRIMARY[task]
    lines = [
        f"**{task}** ({key}; target {store['target']:.2f} = 95% of DDP fp32's median final; {store['protocol']}; "
        "time = steps to the target x the TTA table's seconds per step on the Ethernet link)",
        "",
        "| method | tuning: median final per lr (chosen **bold**) | held-out seeds reaching the target | "
        "steps to target: median / worst | time to target (s): median / worst | final: median / worst |",
        "|---|---|---|---|---|---|",
    ]
    bands = []
    for label, m in store["methods"].items():
        grid = ", ".join(
            ("**{}: {:.1f}**" if float(lr) == m["chosen"] else "{}: {:.1f}").format(lr, t["median"])
            + (" (diverged)" if t["disqualified"] else "")
            for lr, t in m["tuning"].items()
        )
        h = m.get("held_out")
        if not h:
            lines.append(f"| {label} | {grid} | none chosen | | | |")
            continue
        steps = [r["step_to_target"] for r in h["per_seed"].values()]
        reached = sorted(x for x in steps if x is not None)
        worst = "not reached" if len(reached) < len(steps) else reached[-1]
        med = statistics.median([x if x is not None else math.inf for x in steps])
        sps = _s_per_step(task, m["method"])
        t = (lambda x, sps=sps: "not reached" if x in (None, math.inf, "not reached") else f"{x * sps:.0f}")  # noqa: E731
        h["time_to_target_s"] = {"s_per_step": sps, "median": None if med == math.inf else med * sps,
                                 "worst": None if worst == "not reached" else worst * sps}  # fmt: skip
        lines.append(
            f"| {label} | {grid} | {h['reached']} of {h['seeds']} | {med if med != math.inf else 'not reached'} / "
            f"{worst} | {t(med)} / {t(worst)} | {h['median']:.1f} / {h['worst']:.1f} |"
        )
        bands.append((f"{label} (lr {m['chosen']:g})", [r["curve"] for r in h["per_seed"].values()]))
    title = f"{task}: held-out seeds 3-7, median and range"
    sq.plot_seed_bands(bands, key, store["target"], title, results / f"lr_protocol_{task}.png")
    lines.insert(2, f"<!-- numbers: docs/results/lr_protocol_{task}.json -->")
    return sq.write_results(results / f"lr_protocol_{task}", store, lines)  # the JSON with the times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=tuple(sq.PRIMARY), default="qa")
    ap.add_argument("--method", default="2x2", help="KxL simulated Birder workers, or adamw / sgdm")
    ap.add_argument("--grid", nargs="+", type=float, default=[1e-3, 2e-3, 4e-3])
    ap.add_argument("--options", default="{}", help="Birder keyword arguments as JSON")
    ap.add_argument("--warmup", type=float, default=None, help=f"warm-up fraction (default {sq.WARMUP})")
    ap.add_argument("--label", default=None, help="the row's name in the report (default: method + options)")
    ap.add_argument("--steps", type=int, default=None, help="default: the TTA task's (docs/results/tta.json)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--work", type=Path, default=ROOT / "outputs" / "simulate_quality")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--report", action="store_true", help="write the table and figure from the stored JSON")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.task, args.results))
        return 0
    import torch

    torch.set_num_threads(1)
    steps = args.steps or json.loads((ROOT / "docs" / "results" / "tta.json").read_text())["tasks"][args.task]["steps"]
    args.work.mkdir(parents=True, exist_ok=True)
    res = run_method(args.task, args.method, args.grid, args.options, args.work, steps, args.eval_every, args.warmup)
    label = args.label or args.method + ("" if args.options == "{}" else " " + args.options)
    args.results.mkdir(parents=True, exist_ok=True)
    out = args.results / f"lr_protocol_{args.task}.json"
    store = json.loads(out.read_text()) if out.exists() else {"task": args.task, "target": sq.tta_target(args.task)}
    store.setdefault("methods", {})[label] = {"method": args.method, "options": json.loads(args.options),
                                             "steps": steps, "warmup": sq._warmup(args),
                                             "grid": args.grid, **res}  # fmt: skip
    store["protocol"] = f"tune on seeds {list(TUNE)} by the median final, evaluate on held-out seeds {list(HELD_OUT)}"
    out.write_text(json.dumps(store, indent=1) + "\n")
    h = res.get("held_out")
    if h:
        print(f"{label}: lr {res['chosen']:g}; held-out median {h['median']:.2f}, worst {h['worst']:.2f}, "
              f"{h['reached']} of {h['seeds']} reach the target")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
