"""Every seed no choice saw, for each variant of a task, in one table (issue 25): is the spread of seeds gone?

A variant is a row of ``lr_protocol.py``'s report (its rate chosen on seeds 0-2 by the median final). Seeds 3-7 are
the protocol's held-out seeds (curves read from ``docs/results/lr_protocol_{task}.json``); seeds 8 and up were run
afterwards with ``simulate_quality.py`` at the chosen rate (run files read from ``--work``). Per variant: how many
seeds reach the time-to-accuracy target, which miss it, steps to the target and final metric (median and worst).

    python benchmarks/simulate_quality.py --task qa --workers 2x2 --lr 2e-3 --options '{"stale": "fade"}' \\
        --seeds 8 9 10 11 12 13 --work outputs/fresh          # and likewise for each variant below
    python benchmarks/seed_sweep.py --task qa --seeds 3-13 --work outputs/fresh   # docs/results/seed_sweep_qa.*
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

import lr_protocol  # noqa: E402
import simulate_quality as sq  # noqa: E402
from provenance import provenance  # noqa: E402


def _seeds(spec: str) -> list[int]:
    lo, _, hi = spec.partition("-")
    return list(range(int(lo), int(hi or lo) + 1))


def sweep(task: str, seeds: list[int], works: list[Path], results: Path, tag: str = "", steptime=None) -> dict:
    """Every row of ``lr_protocol_{task}{tag}.json`` on ``seeds``: its held-out curves from there, the other seeds'
    from the run files in ``works`` (a seed with no finished run is left out)."""
    key, higher = sq.PRIMARY[task]
    target = sq.tta_target(task)
    protocol = json.loads((results / f"lr_protocol_{task}{tag}.json").read_text())["methods"]
    out = {"task": task, "metric": key, "target": target, "seeds": seeds, "variants": {}}
    for label, row in protocol.items():
        if not row.get("held_out"):
            continue
        lr, held, warmup = row["chosen"], row["held_out"]["per_seed"], row.get("warmup") or sq.WARMUP
        per_seed = {}
        for seed in seeds:
            curve = held[str(seed)]["curve"] if str(seed) in held else _curve(task, row, warmup, seed, works, key)
            if curve is None:
                continue
            evals = [{"step": s, key: v} for s, v in zip(curve["steps"], curve[key])]
            per_seed[seed] = lr_protocol.summarize(evals, key, higher, target) | {"curve": curve}
        finals = [r["final"] for r in per_seed.values()]
        steps = sorted(r["step_to_target"] or math.inf for r in per_seed.values())
        clock, seconds = lr_protocol.seconds_on_link(task, row["method"], row["steps"], steptime)
        at = lambda x, seconds=seconds: None if x == math.inf else seconds[int(x)]  # noqa: E731
        out["variants"][label] = {
            "method": row["method"], "lr": lr, "warmup": warmup, "options": row["options"], "per_seed": per_seed,
            "reached": sum(s != math.inf for s in steps), "missed": [s for s, r in per_seed.items() if
                                                                    r["step_to_target"] is None],
            "steps_to_target_median": statistics.median(steps), "steps_to_target_worst": steps[-1],
            "final_median": statistics.median(finals), "final_worst": (min if higher else max)(finals),
            "clock": clock, "time_to_target_median_s": at(statistics.median(steps)),
            "time_to_target_worst_s": at(steps[-1]),
        }  # fmt: skip
    return out


def _curve(task, row, warmup, seed, works, key) -> dict | None:
    for work in works:
        args = lr_protocol._args(task, row["method"], row["chosen"], json.dumps(row["options"]), work, row["steps"],
                                 50, warmup)  # fmt: skip
        evals = sq.finished_evals(lr_protocol._path(args, row["method"], seed))
        if evals is not None:
            return sq.curve(evals, key)
    return None


def _ranges(seeds: list[int]) -> str:
    """[3, 4, 5, 7, 8] -> '3-5, 7-8'."""
    runs: list[list[int]] = []
    for s in sorted(seeds):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def report(res: dict, results: Path) -> str:
    key, name = res["metric"], f"seed_sweep_{res['task']}{res.get('tag', '')}"
    shown = lambda x: "not reached" if x == math.inf else f"{x:.0f}"  # noqa: E731
    lines = [
        f"<!-- numbers: docs/results/{name}.json -->",
        f"| variant | lr | warm-up | seeds | reaching the target | missing it | steps to target: median / worst | "
        f"time to target (s), median | final {key}: median / worst |",
        "|---|---:|---:|---|---:|---|---|---:|---|",
    ]
    for label, v in res["variants"].items():
        seeds = sorted(v["per_seed"])
        lines.append(
            f"| {label} | {v['lr']:g} | {v['warmup']:.0%} | {_ranges(seeds)} | "
            f"{v['reached']} of {len(seeds)} | {', '.join(map(str, v['missed'])) or 'none'} | "
            f"{shown(v['steps_to_target_median'])} / {shown(v['steps_to_target_worst'])} | "
            f"{shown(v['time_to_target_median_s'] or math.inf)} | "
            f"{v['final_median']:.1f} / {v['final_worst']:.1f} |"
        )
    bands = [(f"{label} (lr {v['lr']:g})", [r["curve"] for r in v["per_seed"].values()])
             for label, v in res["variants"].items()]  # fmt: skip
    title = f"{res['task']}: seeds no choice saw, median and range"
    sq.plot_seed_bands(bands, key, res["target"], title, results / f"{name}.png")
    finite = lambda x: None if x == math.inf else x  # noqa: E731  (JSON has no infinity; None: not reached)
    for v in res["variants"].values():
        v["steps_to_target_median"], v["steps_to_target_worst"] = map(
            finite, (v["steps_to_target_median"], v["steps_to_target_worst"])
        )
    return sq.write_results(results / name, res, lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=tuple(sq.PRIMARY), default="qa")
    ap.add_argument("--seeds", default="3-13", help="a range, e.g. 3-13")
    ap.add_argument("--work", type=Path, nargs="+", default=[ROOT / "outputs" / "simulate_quality"])
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--tag", default="", help="the protocol file lr_protocol_{task}{tag}.json; results get it too")
    ap.add_argument("--steptime", type=Path, default=None, help="as lr_protocol.py --report --steptime")
    args = ap.parse_args(argv)
    res = sweep(args.task, _seeds(args.seeds), args.work, args.results, args.tag, args.steptime)
    print(report(res | {"tag": args.tag} | provenance(__file__, argv), args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
