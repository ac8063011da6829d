"""Convergence of 1-bit HSDP on the causal-LM recipe: HSDP-Birder vs HSDP-AdamW vs DDP-Birder (issue 15).

Runs ``recipes/causal_lm.py`` as users run it (``torchrun``, 4 CPU processes as 2 simulated nodes x 2), the same data,
model, steps, learning-rate schedule and seeds for every method:

- ``hsdp-birder``: FSDP2 inside each node, Birder's 1-bit all-reduce across the nodes (``--sharding hsdp``);
- ``hsdp-adamw``: native HSDP with AdamW (FSDP2 on the 2-D mesh: full-precision all-reduce across the nodes);
- ``ddp-birder``: every rank holds the whole model, Birder's hierarchical 1-bit DDP hook.

It writes the validation loss/perplexity and training-loss curves of every run and their mean ± std over seeds to
``docs/results/hsdp_convergence.json``, a plot to ``hsdp_convergence.png`` and a table to ``hsdp_convergence.md``.

    python benchmarks/hsdp_convergence.py                   # 3 seeds x 3 methods, 150 steps (~45 min, 2 busy cores)
    python benchmarks/hsdp_convergence.py --plot_only       # redraw from the runs already in --work_dir

Runs are resumable: a run whose ``all_results.json`` exists is read, not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

METHODS = {  # method -> (label, colour, recipe arguments)
    "hsdp-birder": ("HSDP + Birder (1 bit across nodes)", "#d94801", ["--sharding", "hsdp"]),
    "hsdp-adamw": ("HSDP + AdamW (fp32 across nodes)", "#4c72b0", ["--sharding", "hsdp", "--optimizer", "adamw"]),
    "ddp-birder": ("DDP + Birder (hierarchical 1-bit)", "#fdae6b", []),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_args(method: str, seed: int, cfg: argparse.Namespace) -> list[str]:
    """The recipe's arguments for one run (everything but the method's own flags is shared)."""
    return [
        *METHODS[method][2],
        "--num_nodes",
        str(cfg.num_nodes),
        "--seed",
        str(seed),
        "--max_steps",
        str(cfg.steps),
        "--eval_steps",
        str(cfg.eval_steps),
        "--logging_steps",
        str(cfg.logging_steps),
        "--learning_rate",
        str(cfg.birder_lr if method.endswith("birder") else cfg.adamw_lr),
        *(["--update_rule", cfg.update_rule] if method.endswith("birder") else []),
        "--max_eval_blocks",
        str(cfg.max_eval_blocks),
        "--warmup_steps",
        str(cfg.warmup_steps),
        *cfg.extra,
    ]


def run_one(method: str, seed: int, cfg: argparse.Namespace) -> Path:
    out = cfg.work_dir / method / f"seed{seed}"
    if (out / "all_results.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cfg.nproc)]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(ROOT / "recipes" / "causal_lm.py")]
    cmd += [*recipe_args(method, seed, cfg), "--output_dir", str(out), "--cache_dir", str(cfg.work_dir / "data")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    start = time.time()
    with open(out / "run.log", "w") as log:
        res = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=cfg.timeout)
    if res.returncode != 0 or not (out / "all_results.json").exists():
        tail = (out / "run.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{method} seed {seed} failed (exit {res.returncode}):\n{tail}")
    (out / "wall_s.txt").write_text(f"{time.time() - start:.1f}\n")
    return out


def load_run(method: str, seed: int, out: Path) -> dict:
    res = json.loads((out / "all_results.json").read_text())
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    evals = [h for h in history if "eval_loss" in h and "step" in h]
    # the final evaluation is logged twice (at the last step and by the recipe's evaluate()); keep one per step
    by_step = {h["step"]: h["eval_loss"] for h in evals}
    train = [h for h in history if "loss" in h]
    keep = ("comm/inter_node_bytes", "comm/intra_node_bytes", "comm/compression_ratio", "train_runtime")
    return {
        "method": method,
        "seed": seed,
        "eval_steps": sorted(by_step),
        "eval_loss": [by_step[s] for s in sorted(by_step)],
        "train_steps": [h["step"] for h in train],
        "train_loss": [h["loss"] for h in train],
        "final_eval_loss": res["eval_loss"],
        "final_eval_perplexity": res["eval_perplexity"],
        "memory": {k.split("/", 1)[1]: v for k, v in res.items() if k.startswith("memory/")},
        **{k: res[k] for k in keep if k in res},
        "num_parameters": res["num_parameters"],
        # the launch's wall time (start-up, tokenizing on a cold cache, training, evaluation, saving)
        "wall_s": float((out / "wall_s.txt").read_text()) if (out / "wall_s.txt").exists() else None,
    }


def _mean_std(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}


def summarize(records: list[dict]) -> dict:
    out = {}
    for method in METHODS:
        rs = [r for r in records if r["method"] == method]
        if rs:
            sent = rs[0].get("comm/inter_node_bytes")
            out[method] = {
                "seeds": [r["seed"] for r in rs],
                "num_seeds": len(rs),
                "final_eval_loss": _mean_std([r["final_eval_loss"] for r in rs]),
                "final_eval_perplexity": _mean_std([r["final_eval_perplexity"] for r in rs]),
                "inter_node_bytes_per_rank": sent,
                "inter_node_megabytes_per_rank": None if sent is None else round(sent / 1e6, 2),
            }
    return out


def table_markdown(summary: dict, cfg: dict) -> str:
    lines = [
        f"Validation loss and perplexity after {cfg['steps']} steps (mean ± std over seeds {cfg['seeds']}; "
        f"{cfg['nproc']} CPU processes as {cfg['num_nodes']} nodes; learning rate Birder {cfg['birder_lr']:g}, AdamW "
        f"{cfg['adamw_lr']:g}; `python benchmarks/hsdp_convergence.py`).",
        "",
        "| method | seeds | validation loss | validation perplexity | 1-bit bytes sent across nodes per rank, all "
        f"{cfg['steps']} steps |",
        "|---|---|---|---|---|",
    ]
    for method, s in summary.items():
        loss, ppl = s["final_eval_loss"], s["final_eval_perplexity"]
        sent = s["inter_node_megabytes_per_rank"]
        sent = "fp32 all-reduce (not counted)" if sent is None else f"{sent:.2f} MB"
        lines.append(
            f"| {METHODS[method][0]} | {s['num_seeds']} | {loss['mean']:.3f} ± {loss['std']:.3f} | "
            f"{ppl['mean']:.1f} ± {ppl['std']:.1f} | {sent} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for method, (label, colour, _) in METHODS.items():
        rs = [r for r in records if r["method"] == method]
        for ax, xkey, ykey in ((axes[0], "eval_steps", "eval_loss"), (axes[1], "train_steps", "train_loss")):
            for i, r in enumerate(rs):
                ax.plot(r[xkey], r[ykey], color=colour, alpha=0.8, lw=1.2, label=label if i == 0 else None)
    axes[0].set(title="validation loss (each seed)", xlabel="step", ylabel="loss")
    axes[1].set(title="training loss, rank 0 (each seed)", xlabel="step", ylabel="loss")
    axes[0].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("Causal LM on the Python stdlib (tiny GPT-2, 4 CPU ranks as 2 nodes x 2)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--num_nodes", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval_steps", type=int, default=30)
    p.add_argument("--logging_steps", type=int, default=10)
    # Birder: the best of 2e-3 / 5e-4 / 2e-4 on hsdp-birder, seed 0 (docs/results/hsdp_lr_check_birder_*.json)
    p.add_argument("--birder_lr", type=float, default=5e-4, help="Birder's learning rate (both layouts).")
    p.add_argument("--update_rule", default="birder", help="The recipe's Birder rule (the stored runs': birder).")
    p.add_argument("--adamw_lr", type=float, default=2e-3, help="AdamW's learning rate.")
    p.add_argument("--max_eval_blocks", type=int, default=256)
    p.add_argument("--warmup_steps", type=float, default=20, help="The stored runs': 20 of 150 steps.")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="More recipe arguments (last).")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--work_dir", type=Path, default=ROOT / "outputs" / "hsdp_convergence")
    p.add_argument("--results_dir", type=Path, default=ROOT / "docs" / "results")
    p.add_argument("--results_name", default="hsdp_convergence", help="Stem of the .json/.md/.png results.")
    p.add_argument("--plot_only", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    records, started = [], time.time()
    for seed in cfg.seeds:  # seed by seed: a partial benchmark has every method at the seeds it reached
        for method in cfg.methods:
            out = cfg.work_dir / method / f"seed{seed}"
            if not cfg.plot_only:
                out = run_one(method, seed, cfg)
                print(f"{method} seed {seed}: done ({time.time() - started:.0f} s so far)", flush=True)
            if (out / "all_results.json").exists():
                records.append(load_run(method, seed, out))
    settings = {k: v for k, v in vars(cfg).items() if k not in ("plot_only", "work_dir", "results_dir", "timeout")}
    result = {
        "settings": settings,
        "recipe_args": {m: recipe_args(m, "<seed>", cfg) for m in cfg.methods},
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "summary": summarize(records),
        "runs": records,
        **provenance(__file__, argv),
    }
    if cfg.results_dir is not None and records:
        cfg.results_dir.mkdir(parents=True, exist_ok=True)
        stem = cfg.results_dir / cfg.results_name
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        stem.with_suffix(".md").write_text(table_markdown(result["summary"], settings))
        plot(records, stem.with_suffix(".png"))
        print(table_markdown(result["summary"], settings))
    return result


if __name__ == "__main__":
    main()
