"""Learning rates that hold on seeds nobody tuned on (issue 25, item 2), in one process.

Protocol: each method's peak learning rate is chosen on the tuning seeds (0-2) by the median final metric; a value
with a diverged seed (non-finite, or worse than the untrained model) is disqualified. The chosen value is then run
on held-out seeds (3-7) that no choice saw, and the report gives the median *and the worst* held-out seed, and the
step at which each seed first reaches the time-to-accuracy target (95% of DDP fp32's median final, from
``docs/results/tta.json``).

Birder and the one-process baselines run in ``simulate_quality.py``'s one process (bit-equal to a real 2 x 2 DDP run
with the hook, ``tests/test_simulate_workers.py``); a method of the TTA table that only real ranks can run (PowerSGD,
fp16, 1-bit Adam: ``--method powersgd-r4``) runs as 4 ranks (2 simulated nodes x 2) on loopback with the TTA
worker. Both use the TTA tasks' model, data and schedule, and the same global batch.

    python benchmarks/lr_protocol.py --task qa --method 2x2 --grid 1e-3 2e-3 4e-3
    python benchmarks/lr_protocol.py --task qa --method 2x2 --grid 1e-3 2e-3 4e-3 --options '{"stale": "keep"}'
    python benchmarks/lr_protocol.py --task qa --method adamw --grid 1e-3 2e-3 4e-3
    python benchmarks/lr_protocol.py --task qa --method powersgd-r4 --grid 1e-3 2e-3 4e-3   # real ranks
    python benchmarks/lr_protocol.py --task qa --method powersgd-r4 --rate-from adamw   # AdamW's rate, untuned
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
from provenance import provenance  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks" / "system"))
import tta  # noqa: E402

TUNE, HELD_OUT = (0, 1, 2), (3, 4, 5, 6, 7)


def _args(task, method, lr, options, work, steps, eval_every, warmup=None):
    return argparse.Namespace(task=task, workers=[method], lr=lr, options=options, work=work, steps=steps,
                              eval_every=eval_every, warmup=warmup)  # fmt: skip


REAL_RANKS = tuple(m for m in tta.METHODS if not m.startswith("birder") and m != "fp32")  # the simulation has no hook


def _path(args, method, seed) -> Path:
    if method not in REAL_RANKS:
        return sq._path(args, method, seed)
    return args.work / f"{args.task}-{method}-ranks4-lr{args.lr:g}{sq._warmup_tag(args)}-seed{seed}.jsonl"


def _run(args, method, seed) -> None:
    out = _path(args, method, seed)
    if method not in REAL_RANKS:
        sq._run(args.task, method, seed, args, out)
        return
    ranks = argparse.Namespace(steps=args.steps, batch=sq.GLOBAL_BATCH[args.task] // 4, nproc=4, work=args.work)
    tta.run_local(args.task, method, args.lr, seed, ranks, out, extra=["--lr-warmup", str(sq._warmup(args))])


def _records(args, method, seed):
    return sq.finished_evals(_path(args, method, seed))


def summarize(evals: list[dict], key: str, higher: bool, target: float) -> dict:
    """Final metric, first step at the target (None: never), and whether the run diverged."""
    final = evals[-1][key]
    reached = next((e["step"] for e in evals if (e[key] >= target if higher else e[key] <= target)), None)
    diverged = not math.isfinite(final) or (final <= evals[0][key] if higher else final >= evals[0][key])
    return {"final": final, "step_to_target": reached, "diverged": diverged}


def run_method(task, method, grid, options, work, steps, eval_every, warmup=None, rate=None) -> dict:
    """Tune on TUNE, pick by median (diverged seeds disqualify), run HELD_OUT at the pick. Runs what is missing.

    A given ``rate`` (another row's choice) skips the tuning: the row of a wrapper (PowerSGD, fp16 around
    AdamW) takes its optimizer's rate, as a user switching on the hook does (the TTA table's ``SHARED_LR``)."""
    key, higher = sq.PRIMARY[task]
    target = sq.tta_target(task)

    def runs(lr, seeds):
        a = _args(task, method, lr, options, work, steps, eval_every, warmup)
        out = {}
        for s in seeds:
            if _records(a, method, s) is None:
                print(f"[lr_protocol] {task} {method} lr={lr:g} {options} seed {s}", flush=True)
                _run(a, method, s)
            evals = _records(a, method, s)
            out[s] = summarize(evals, key, higher, target) | {"curve": sq.curve(evals, key)}
        return out

    tuning = {}
    for lr in grid if rate is None else []:
        res = runs(lr, TUNE)
        finals = [r["final"] for r in res.values()]
        ok = not any(r["diverged"] for r in res.values())
        tuning[f"{lr:g}"] = {"median": statistics.median(finals), "disqualified": not ok,
                             "per_seed": {s: r["final"] for s, r in res.items()}}  # fmt: skip
    if rate is None:
        candidates = {lr: t for lr, t in tuning.items() if not t["disqualified"]}
        if not candidates:
            return {"tuning": tuning, "chosen": None}
        rate = (max if higher else min)(candidates, key=lambda lr: candidates[lr]["median"])
    held = runs(float(rate), HELD_OUT)
    finals = [r["final"] for r in held.values()]
    steps_to = [r["step_to_target"] for r in held.values()]
    return {
        "tuning": tuning,
        "chosen": float(rate),
        "held_out": {
            "per_seed": {s: {k: v for k, v in r.items()} for s, r in held.items()},
            "median": statistics.median(finals),
            "worst": (min if higher else max)(finals),
            "reached": sum(s is not None for s in steps_to),
            "seeds": len(steps_to),
        },
    }


def _row(method: str) -> str:
    """The TTA table's method whose seconds per step a protocol row takes: DDP fp32's for AdamW / SGDM, Birder
    hierarchical's for simulated workers, a real-rank method's own."""
    return "fp32" if method in sq.BASELINES else method if method in REAL_RANKS else "birder-h"


def step_times(task: str, method: str, steptime_work: Path | None) -> dict:
    """Seconds per step on the TTA table's emulated link, (fp32 phase, compressed phase): from a ``tta.py steptime``
    run in ``steptime_work`` (every method measured side by side), or else the TTA table's stored ones."""
    row = _row(method)
    if steptime_work is not None:
        phases = tta._phase_times(task, row, argparse.Namespace(work=steptime_work))
        return {"s_per_step": list(phases), "source": f"tta.py steptime, {row}"}
    methods = json.loads((ROOT / "docs" / "results" / "tta.json").read_text())["tasks"][task]["methods"]
    return {"s_per_step": methods[row]["s_per_step"], "source": f"docs/results/tta.json, {row}"}


def seconds_on_link(task: str, method: str, steps: int, steptime_work: Path | None) -> tuple[dict, list[float]]:
    """:func:`step_times` and the seconds on the link after each step 0..steps (PowerSGD's first 10%, the TTA
    worker's default ``--warmup-frac``, at its fp32-phase rate)."""
    clock = step_times(task, method, steptime_work)
    return clock, tta.phase_clock(*clock["s_per_step"], _row(method), steps, 0.1)


def report(task: str, results: Path, steptime_work: Path | None = None, tag: str = "") -> str:
    """A markdown table and a figure (held-out seeds' curves) from ``lr_protocol_{task}{tag}.json``."""
    name = f"lr_protocol_{task}{tag}"
    store = json.loads((results / f"{name}.json").read_text())
    key, higher = sq.PRIMARY[task]
    lines = [
        f"**{task}** ({key}; target {store['target']:.2f} = 95% of DDP fp32's median final; {store['protocol']}; "
        "time = seconds on the TTA table's Ethernet link at the step that reaches the target, PowerSGD's first 10% "
        "at its fp32 rate)",
        "",
        "| method | tuning: median final per lr (chosen **bold**) | held-out seeds reaching the target | "
        "steps to target: median / worst | time to target (s): median / worst | final: median / worst |",
        "|---|---|---|---|---|---|",
    ]
    bands = []
    for label, m in store["methods"].items():
        grid = (
            ", ".join(
                ("**{}: {:.1f}**" if float(lr) == m["chosen"] else "{}: {:.1f}").format(lr, t["median"])
                + (" (diverged)" if t["disqualified"] else "")
                for lr, t in m["tuning"].items()
            )
            or f"{m['chosen']:g}: {m['rate_from']}'s rate, not tuned"
        )
        h = m.get("held_out")
        if not h:
            lines.append(f"| {label} | {grid} | none chosen | | | |")
            continue
        steps = [r["step_to_target"] for r in h["per_seed"].values()]
        reached = sorted(x for x in steps if x is not None)
        worst = "not reached" if len(reached) < len(steps) else reached[-1]
        med = statistics.median([x if x is not None else math.inf for x in steps])
        clock, seconds = seconds_on_link(task, m["method"], m["steps"], steptime_work)
        finite = [x for x in (med, worst) if isinstance(x, (int, float)) and math.isfinite(x)]
        secs = {x: seconds[int(x)] for x in finite}
        t = lambda x, secs=secs: f"{secs[x]:.0f}" if x in secs else "not reached"  # noqa: E731
        h["time_to_target_s"] = {**clock, "median": secs.get(med), "worst": secs.get(worst)}
        lines.append(
            f"| {label} | {grid} | {h['reached']} of {h['seeds']} | {med if med != math.inf else 'not reached'} / "
            f"{worst} | {t(med)} / {t(worst)} | {h['median']:.1f} / {h['worst']:.1f} |"
        )
        bands.append((f"{label} (lr {m['chosen']:g})", [r["curve"] for r in h["per_seed"].values()]))
    title = f"{task}: held-out seeds 3-7, median and range"
    sq.plot_seed_bands(bands, key, store["target"], title, results / f"{name}.png")
    lines.insert(2, f"<!-- numbers: docs/results/{name}.json -->")
    return sq.write_results(results / name, store, lines)  # the JSON with the times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=tuple(sq.PRIMARY), default="qa")
    ap.add_argument(
        "--method",
        default="2x2",
        help=f"KxL simulated Birder workers, adamw / sgdm (one process), or real ranks: {REAL_RANKS}",
    )
    ap.add_argument("--grid", nargs="+", type=float, default=[1e-3, 2e-3, 4e-3])
    ap.add_argument("--options", default="{}", help="Birder keyword arguments as JSON")
    ap.add_argument("--warmup", type=float, default=None, help=f"warm-up fraction (default {sq.WARMUP})")
    ap.add_argument("--label", default=None, help="the row's name in the report (default: method + options)")
    ap.add_argument("--steps", type=int, default=None, help="default: the TTA task's (docs/results/tta.json)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--work", type=Path, default=ROOT / "outputs" / "simulate_quality")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--report", action="store_true", help="write the table and figure from the stored JSON")
    ap.add_argument("--tag", default="", help="results file suffix: lr_protocol_{task}{tag}.json")
    ap.add_argument("--rate-from", default=None, metavar="LABEL",
                    help="no tuning: take the rate the row LABEL of the same results file chose (a wrapper such as "
                    "PowerSGD takes its optimizer's), and run the held-out seeds only")  # fmt: skip
    ap.add_argument("--steptime", type=Path, default=None,
                    help="a tta.py --work folder with a steptime run: take the seconds per step from it "
                    "(default: docs/results/tta.json's)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.task, args.results, args.steptime, args.tag))
        return 0
    import torch

    torch.set_num_threads(1)
    steps = args.steps or json.loads((ROOT / "docs" / "results" / "tta.json").read_text())["tasks"][args.task]["steps"]
    args.work.mkdir(parents=True, exist_ok=True)
    out = args.results / f"lr_protocol_{args.task}{args.tag}.json"
    rate = None
    if args.rate_from is not None:
        rows = json.loads(out.read_text())["methods"] if out.exists() else {}
        rate = rows.get(args.rate_from, {}).get("chosen")
        if rate is None:
            raise SystemExit(f"--rate-from {args.rate_from!r}: no row of {out} with that label has chosen a rate; run "
                             f"it first (rows there: {sorted(rows)})")  # fmt: skip
    res = run_method(args.task, args.method, args.grid, args.options, args.work, steps, args.eval_every, args.warmup,
                     rate)  # fmt: skip
    label = args.label or args.method + ("" if args.options == "{}" else " " + args.options)
    args.results.mkdir(parents=True, exist_ok=True)
    store = json.loads(out.read_text()) if out.exists() else {"task": args.task, "target": sq.tta_target(args.task)}
    prov = provenance(__file__, argv)  # the row's run; the file's top level: its last run's
    store.setdefault("methods", {})[label] = {"method": args.method, "options": json.loads(args.options),
                                             "steps": steps, "warmup": sq._warmup(args),
                                             "grid": [] if rate is not None else args.grid, **res,
                                             **prov}  # fmt: skip
    if rate is not None:
        store["methods"][label]["rate_from"] = args.rate_from
    store["protocol"] = f"tune on seeds {list(TUNE)} by the median final, evaluate on held-out seeds {list(HELD_OUT)}"
    store.update(prov)
    out.write_text(json.dumps(store, indent=1) + "\n")
    h = res.get("held_out")
    if h:
        print(f"{label}: lr {res['chosen']:g}; held-out median {h['median']:.2f}, worst {h['worst']:.2f}, "
              f"{h['reached']} of {h['seeds']} reach the target")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
