"""Is it the vote's noise or the update rule? The causal-LM recipe in one process with d = u (``--quantize False``:
no vote, no noise) and Birder's encoder swapped for variants of Adam's (issue 38).

    python benchmarks/update_rule_ablation.py --seeds 0 1 2    # docs/results/update_rule_ablation_lm.json / .md
    python benchmarks/update_rule_ablation.py --seeds 0 1 2 --tag _clipping --variants adam-bounded-b2_0.99 \
        adam-bounded-b2_0.95 adam-bounded-lagclip adam-bounded-tclip birder-tclip

Variants (``--learning_rate`` each: the recipe's Birder default, AdamW's default for Adam's rule):

- ``birder`` (5e-4): Birder's own encoder, ``u = m / b`` with one beta (0.95): ``|u| <= 1`` by construction, which is
  what makes the 1-bit vote of ``u`` unbiased;
- ``adam`` (2e-3): ``u = m_hat / (sqrt(v_hat) + 1e-8)``, beta1 0.9, beta2 0.999, bias-corrected: Adam's direction
  (through Birder's step it equals the recipe's AdamW run without gradient clipping: ``--max_grad_norm 0``);
- ``adam-bounded`` (2e-3): the same, clipped to ``[-1, 1]`` per coordinate, the bound Birder's vote needs;
- ``adam-bounded-b2_X``: ``adam-bounded`` with beta2 = X (a shorter memory of g**2 instead of the clip);
- ``...-lagclip``: clipped by the previous step's global norm (what a hook that sees one bucket at a time could know);
- ``...-tclip``: each tensor's gradient clipped to its share ``sqrt(n_i / N)`` of a global norm of 1 (what
  ``Birder(grad_clip=1.0)`` does, in the library since);
- ``...-clip``: each of them with the gradient clipped to a global norm of 1 before the step, as the Trainer does for
  AdamW (``max_grad_norm=1.0``; ``BirderTrainer`` turns it off, since under the hook ``.grad`` holds the direction).

The swap replaces ``birder_hf.optim.birder_encode`` in the recipe's process (an experiment harness, not a supported
option) on the recipe's ``--update_rule birder`` (the paper's m / b path, its default when these runs were made);
everything else is the recipe with its defaults (150 steps, 20% warm-up, cosine, weight decay 0.01). Runs
whose ``all_results.json`` exists in ``--work`` are read, not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"birder": "5e-4", "adam": "2e-3", "adam-bounded": "2e-3", "birder-clip": "5e-4", "adam-clip": "2e-3",
            "adam-bounded-clip": "2e-3", "adam-bounded-b2_0.99": "2e-3", "adam-bounded-b2_0.95": "2e-3",
            "adam-bounded-lagclip": "2e-3", "adam-bounded-tclip": "2e-3",
            "birder-tclip": "5e-4"}  # fmt: skip


def _adam_encode(bounded: bool, beta2: float = 0.999):
    steps: dict[int, int] = {}

    def encode(
        grads, ms, vs, _max=None, *, beta, maximize=False, foreach=None, stale="keep", out=None, grad_scale=1.0, **_
    ):  # **_: the library's own beta2 / eps / steps / clip_norms, unused here
        if out is not None or maximize:
            raise NotImplementedError("the ablation runs step() in one process only")
        us = []
        for g, m, v in zip(grads, ms, vs):  # Birder's m and b buffers hold Adam's m and v
            g = g.float() / grad_scale
            t = steps[id(m)] = steps.get(id(m), 0) + 1
            m.mul_(0.9).add_(g, alpha=0.1)
            v.mul_(beta2).add_(g * g, alpha=1 - beta2)
            u = (m / (1 - 0.9**t)) / ((v / (1 - beta2**t)).sqrt() + 1e-8)
            us.append(u.clamp_(-1, 1) if bounded else u)
        return us

    return encode


def _run_recipe(variant: str, recipe_args: list[str]) -> None:
    # in the child process: swap the encoder, then run the recipe as its own __main__
    import torch

    import birder_hf.optim

    rule, clip = variant, ""
    for suffix in ("-lagclip", "-tclip", "-clip"):
        if variant.endswith(suffix):
            rule, clip = variant.removesuffix(suffix), suffix[1:]
            break
    rule, _, beta2 = rule.partition("-b2_")
    if rule != "birder":
        birder_hf.optim.birder_encode = _adam_encode(rule == "adam-bounded", float(beta2 or 0.999))
    step = birder_hf.optim.Birder.step

    def grads_of(opt):
        return [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]

    if clip == "lagclip":  # clipped by the previous step's global norm (what a bucket-wise hook knows)
        last = [0.0]

        def clipped_step(self, *args, **kwargs):
            grads = grads_of(self)
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            if last[0] > 1.0:
                torch._foreach_mul_(grads, 1.0 / last[0])
            last[0] = norm
            return step(self, *args, **kwargs)

    elif clip == "tclip":  # each tensor's gradient clipped to its share of a global norm of 1

        def clipped_step(self, *args, **kwargs):
            grads = grads_of(self)
            total = sum(g.numel() for g in grads)
            for g in grads:
                bound = (g.numel() / total) ** 0.5
                norm = float(torch.linalg.vector_norm(g))
                if norm > bound:
                    g.mul_(bound / norm)
            return step(self, *args, **kwargs)

    elif clip == "clip":  # the gradient clipped to a global norm of 1 before the step, as the Trainer does

        def clipped_step(self, *args, **kwargs):
            torch.nn.utils.clip_grad_norm_(grads_of(self), 1.0)
            return step(self, *args, **kwargs)

    if clip:
        birder_hf.optim.Birder.step = clipped_step
    sys.argv = ["causal_lm.py", *recipe_args]
    runpy.run_path(str(ROOT / "recipes" / "causal_lm.py"), run_name="__main__")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--work", type=Path, default=Path("outputs/update_rule_ablation"))
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    parser.add_argument("--tag", default="", help="appended to the results' file names")
    parser.add_argument("--_child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        _run_recipe(args._child[0], args._child[1:])
        return {}
    prov = provenance(__file__, argv)  # this file's key for the commit is "commit"
    res = {"command": prov["command"],
           "metric": "eval_perplexity", "seeds": args.seeds, "cells": {}}  # fmt: skip
    for variant in args.variants:
        finals = {}
        for seed in args.seeds:
            out = args.work / f"{variant}-seed{seed}"
            if not (out / "all_results.json").exists():
                recipe = ["--output_dir", str(out), "--seed", str(seed), "--quantize", "False",
                          "--update_rule", "birder", "--learning_rate", VARIANTS[variant]]  # fmt: skip
                env = dict(os.environ, OMP_NUM_THREADS="1", BIRDER_HF_CODEC_COMPILE="0")
                print(f"[{variant} seed {seed}]", flush=True)
                subprocess.run([sys.executable, __file__, "--_child", variant, *recipe], env=env, check=True)
            finals[seed] = json.loads((out / "all_results.json").read_text())["eval_perplexity"]
        values = list(finals.values())
        res["cells"][variant] = {"lr": float(VARIANTS[variant]), "final": finals, "median": statistics.median(values),
                                 "worst": max(values)}  # fmt: skip
    res["commit"], res["dirty"] = prov["report_commit"], prov["dirty"]
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / f"update_rule_ablation_lm{args.tag}"
    Path(f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    rows = [f"| {v} | {VARIANTS[v]} | {c['median']:.1f} | {c['worst']:.1f} |" for v, c in res["cells"].items()]
    table = [f"<!-- numbers: docs/results/{stem.name}.json -->", "| direction | lr | median | worst seed |",
             "|---|---|---:|---:|", *rows]  # fmt: skip
    Path(f"{stem}.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    return res


if __name__ == "__main__":
    main()
