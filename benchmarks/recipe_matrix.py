"""The recipes' quality across layouts, settings and seeds (issue 38's quality matrix, on real ranks).

    python benchmarks/recipe_matrix.py --task qa --layouts 1 1x2 2x2 --seeds 3 4 5 \
        --configs "birder=" "birder-beta0.8=--beta 0.8" "adamw=--optimizer adamw" --tag _beta

Runs ``recipes/bert_base.py`` (``--task qa``: tiny BERT on the embedded SQuAD-format data, F1) or
``recipes/causal_lm.py`` (``--task lm``: tiny GPT-2 on the standard library's text, validation perplexity) or
``recipes/resnet50.py`` (``--task image``: a timm ResNet on the embedded digits, validation top-1) with their
defaults plus each config's arguments, once per layout and seed, and writes ``docs/results/recipe_matrix_{task}{tag}``
``.json`` / ``.md`` / ``.png``: per layout and config, the median and the worst seed (and, in the JSON, the bytes each
run's rank 0 sent, its ``comm/`` metrics). Layouts: ``1`` is one process
(plain ``python``, no communication); ``KxL`` is K simulated nodes of L CPU processes through ``accelerate launch``
(``--num_nodes K``: the hierarchical 1-bit all-reduce between the K groups). The batch per process is the recipe's,
so the global batch grows with the layout, as users run. A run whose ``all_results.json`` is already in ``--work``
is read, not run again (the matrix can be filled a few runs at a time). ``--seeds`` sets the recipe's ``--seed``
(model initialization, data order and Birder's bits).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import socket
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TASKS = {  # recipe, metric in all_results.json, higher is better
    "qa": ("bert_base.py", "eval_f1", True),
    "lm": ("causal_lm.py", "eval_perplexity", False),
    "image": ("resnet50.py", "final_val_top1", True),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_config(text: str) -> tuple[str, list[str]]:
    """``"name=--flag value ..."`` -> ``(name, ["--flag", "value", ...])`` (nothing after ``=``: the defaults)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--configs {text!r}: write NAME=RECIPE_ARGS (e.g. 'adamw=--optimizer adamw', 'birder=')")
    return name, shlex.split(rest)


def processes(layout: str) -> tuple[int, int]:
    """``"1"`` -> (1, 1); ``"KxL"`` -> (K, L)."""
    if layout == "1":
        return 1, 1
    try:
        nodes, local = map(int, layout.split("x"))
    except ValueError:
        raise SystemExit(f"layout {layout!r}: write 1 or KxL (nodes x processes per node)") from None
    return nodes, local


def run_one(task: str, layout: str, name: str, extra: list[str], seed: int, work: Path) -> dict:
    out = work / task / f"{layout}-{name}-seed{seed}"
    results = out / "all_results.json"
    if not results.exists():
        nodes, local = processes(layout)
        recipe = [str(ROOT / "recipes" / TASKS[task][0]), "--output_dir", str(out), "--seed", str(seed), *extra]
        # eager codec kernels: the same bits as the compiled ones (tests/test_quantize.py), without a minute of
        # compiling in every rank of every short run
        env = dict(os.environ, OMP_NUM_THREADS="1", BIRDER_HF_CODEC_COMPILE="0")
        if nodes * local == 1:
            cmd = [sys.executable, *recipe]
        else:
            env["ACCELERATE_USE_CPU"] = "1"
            cmd = ["accelerate", "launch", "--config_file", str(ROOT / "accelerate_configs" / "cpu.yaml"),
                   "--num_processes", str(nodes * local), "--num_machines", "1",
                   "--main_process_port", str(_free_port()), *recipe]  # fmt: skip
            birder = "--optimizer" not in extra or extra[extra.index("--optimizer") + 1] in ("birder", "onebitadam")
            if birder or "--local_steps" in extra:  # the 1-bit exchange's (or the outer exchange's) node layout
                cmd += ["--num_nodes", str(nodes)]
        print(f"[{layout} {name} seed {seed}] {shlex.join(cmd)}", flush=True)
        log = out.with_name(out.name + ".log")  # not with_suffix: a name like beta0.8-seed0 has a dot
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            subprocess.run(cmd, env=env, check=True, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    metrics = json.loads(results.read_text())
    if task == "image":  # the accelerate loop logs rank 0's training loss itself
        losses = [{"step": h["step"], "loss": h["train_loss"]} for h in metrics["steps"]]
    else:
        losses = [h for h in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in h]
    comm = {k: v for k, v in metrics.items() if k.startswith("comm/") and isinstance(v, (int, float))}
    return {"final": metrics[TASKS[task][1]], "train_loss": {"steps": [h["step"] for h in losses],
            "loss": [h["loss"] for h in losses]}, "comm": comm}  # fmt: skip


def report(res: dict, stem: Path) -> None:
    metric, higher = res["metric"], res["higher_is_better"]
    lines = [
        f"**{res['task']}** ({metric}; `{res['recipe']}` defaults; seeds {', '.join(map(str, res['seeds']))}; "
        "median / worst seed)",
        "",
        f"<!-- numbers: docs/results/{stem.name}.json -->",
        "| layout | processes | seeds run | " + " | ".join(res["configs"]) + " |",
        "|---|---|---|" + "---|" * len(res["configs"]),
    ]
    for layout, row in res["cells"].items():
        nodes, local = processes(layout)
        cells = [f"{c['median']:.1f} / {c['worst']:.1f}" if c else "" for c in (row.get(n) for n in res["configs"])]
        seeds = max((len(c["final"]) for c in row.values()), default=0)
        lines.append(f"| {layout} | {nodes * local} | {seeds} | " + " | ".join(cells) + " |")
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    layouts = list(res["cells"])
    for i, name in enumerate(res["configs"]):
        xs = [j + (i - (len(res["configs"]) - 1) / 2) * 0.8 / len(res["configs"]) for j in range(len(layouts))]
        for x, layout in zip(xs, layouts):
            cell = res["cells"][layout].get(name)
            if cell:
                finals = list(cell["final"].values())
                ax.plot([x] * len(finals), finals, "o", ms=3, alpha=0.5, color=f"C{i}")
                ax.plot([x], [cell["median"]], "_", ms=14, mew=2, color=f"C{i}", label=name if x == xs[0] else None)
    ax.set_xticks(range(len(layouts)), layouts)
    ax.set_xlabel("layout (nodes x processes; batch per process fixed)")
    ax.set_ylabel(metric)
    if not higher:
        ax.set_yscale("log")
    ax.set_title(f"{res['task']}: every seed (dots) and the median (bar)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(f"{stem}.png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=tuple(TASKS), default="qa")
    ap.add_argument("--layouts", nargs="+", default=["1", "1x2", "2x2"])
    ap.add_argument("--configs", nargs="+", default=["birder=", "adamw=--optimizer adamw"],
                    help="NAME=RECIPE_ARGS, e.g. 'birder-beta0.8=--beta 0.8'")  # fmt: skip
    ap.add_argument("--seeds", nargs="+", type=int, default=[3, 4, 5])
    ap.add_argument("--work", type=Path, default=ROOT / "outputs" / "recipe_matrix")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--tag", default="", help="appended to the results' file names")
    ap.add_argument("--report", action="store_true", help="only read the runs in --work (run nothing)")
    args = ap.parse_args(argv)
    configs = dict(parse_config(c) for c in args.configs)
    recipe, metric, higher = TASKS[args.task]
    res = {"task": args.task, "recipe": f"recipes/{recipe}", "metric": metric, "higher_is_better": higher,
           **provenance(__file__, argv), "seeds": args.seeds, "configs": configs, "cells": {}}  # fmt: skip
    for layout in args.layouts:
        row = res["cells"].setdefault(layout, {})
        for name, extra in configs.items():
            finals = {}
            for seed in args.seeds:
                done = (args.work / args.task / f"{layout}-{name}-seed{seed}" / "all_results.json").exists()
                if args.report and not done:
                    continue
                finals[seed] = run_one(args.task, layout, name, extra, seed, args.work)
            if finals:
                values = [r["final"] for r in finals.values()]
                row[name] = {"final": {s: r["final"] for s, r in finals.items()}, "median": statistics.median(values),
                             "worst": (min if higher else max)(values),
                             "curves": {s: r["train_loss"] for s, r in finals.items()}}  # fmt: skip
                if any(r["comm"] for r in finals.values()):  # the bytes each rank sent (all_results.json's comm/)
                    row[name]["comm"] = {s: r["comm"] for s, r in finals.items()}
    stem = args.results / f"recipe_matrix_{args.task}{args.tag}"
    args.results.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    report(res, stem)
    print(Path(f"{stem}.md").read_text())
    return 0 if all(math.isfinite(c["median"]) for row in res["cells"].values() for c in row.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
