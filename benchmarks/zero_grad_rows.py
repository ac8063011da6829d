"""Word-embedding rows that never get a gradient: how far Birder moves them, before and after antithetic pairs.

    python benchmarks/zero_grad_rows.py --out docs/results/zero_grad_rows.json

Trains the BERT recipe (``recipes/bert_base.py``: tiny BERT on the embedded SQuAD-format data, Birder through the
Trainer's DDP hook) with torchrun on CPU processes, by default 4 as 2 simulated nodes x 2 (the hierarchical 1-bit
all-reduce), 200 steps, weight decay 0 (so that every move of such a row is the quantizer's), twice:

- ``before``: the library and recipe of ``--before_ref`` (default: main before antithetic pairs, when every rank
  drew independently), extracted with ``git archive`` (so this needs a git checkout);
- ``after``: this checkout.

A row "never got a gradient" if its ``b`` (``exp_avg_abs``) is 0 on every rank at the last step (read from the
per-rank Birder state of the final checkpoint). Its move is ``|x_T - x_0|`` per element, with ``x_0`` rebuilt from
the recipe's seed and code, reported in units of the peak learning rate (the schedule decays linearly to 0).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE_REF = "a9b33d12295b6527972e479418721d4018d75b39"  # main, the last commit with independent draws per rank
WORD_EMBEDDINGS = "bert.embeddings.word_embeddings.weight"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True).stdout.strip()


def _extract(ref: str, dest: str) -> None:
    """``src/`` and ``recipes/`` of ``ref`` into ``dest``."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", ref, "src", "recipes"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)


def train(tree: str, out: str, args) -> float:
    """Run ``tree``'s BERT recipe with ``tree``'s library; returns the wall seconds."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(args.nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        os.path.join(tree, "recipes", "bert_base.py"),
        "--max_steps",
        str(args.max_steps),
        "--num_nodes",
        str(args.num_nodes),
        "--weight_decay",
        "0",
        "--warmup_steps",  # the stored run's schedule (the recipe's default before it became 20%)
        "0",
        "--save_strategy",
        "steps",
        "--save_steps",
        str(args.max_steps),
        "--embedded_num_eval",
        "40",  # evaluation is not what is measured here
        "--logging_steps",
        "50",
        "--output_dir",
        out,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.path.join(tree, "src")}
    t0 = time.time()
    res = subprocess.run(argv, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"the recipe failed ({tree}):\n{(res.stdout + res.stderr)[-4000:]}")
    return time.time() - t0


def measure(out: str, args) -> dict:
    """Rows of the word embeddings with ``b = 0`` on every rank, and how far they (and the others) moved."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from birder_hf.checkpoint import read_rank_state

    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from bert_base import ModelArguments, build_model

    tokenizer = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(42)  # the recipe's seed: the same initial weights
    x0 = build_model(ModelArguments(), tokenizer).state_dict()[WORD_EMBEDDINGS].detach()
    x_t = load_file(os.path.join(out, "model.safetensors"))[WORD_EMBEDDINGS]
    checkpoint = os.path.join(out, f"checkpoint-{args.max_steps}")
    never = torch.ones(x0.shape[0], dtype=torch.bool)
    for rank in range(args.nproc):
        state = read_rank_state(checkpoint, rank=rank, world_size=args.nproc)["state"]
        (b,) = [s["exp_avg_abs"] for s in state.values() if s["exp_avg_abs"].shape == x0.shape]
        never &= (b == 0).all(dim=1)
    move = (x_t - x0).abs().double() / args.learning_rate
    rest = move[~never]
    return {
        "vocab_rows": x0.shape[0],
        "rows_without_gradient": int(never.sum()),
        "rows_without_gradient_that_moved": int((move[never] > 0).any(dim=1).sum()),
        "max_move_lr": round(float(move[never].max()), 3) if never.any() else 0.0,
        "mean_move_lr": round(float(move[never].mean()), 3) if never.any() else 0.0,
        "rows_with_gradient_mean_move_lr": round(float(rest.mean()), 3),  # for scale
        "rows_with_gradient_that_stayed": int((rest == 0).all(dim=1).sum()),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before_ref", default=BEFORE_REF, help="git ref of the 'before' library and recipe")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--num_nodes", type=int, default=2, help="simulated nodes (hierarchical all-reduce)")
    ap.add_argument("--max_steps", type=int, default=200)
    ap.add_argument("--learning_rate", type=float, default=2e-3, help="the recipe's default (the unit of moves)")
    ap.add_argument("--out", default="docs/results/zero_grad_rows.json")
    args = ap.parse_args(argv)

    results = {
        **provenance(__file__, argv),
        "recipe": "recipes/bert_base.py (tiny BERT, embedded data, --weight_decay 0, linear decay from lr to 0)",
        "nproc": args.nproc,
        "num_nodes": args.num_nodes,
        "method": "hierarchical",
        "max_steps": args.max_steps,
        "learning_rate": args.learning_rate,
        "torch": torch.__version__,
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        before = os.path.join(tmp, "before_tree")
        os.makedirs(before)
        _extract(args.before_ref, before)
        for name, tree, ref in (("before", before, args.before_ref), ("after", ROOT, "HEAD")):
            out = os.path.join(tmp, name)
            seconds = train(tree, out, args)
            run = {"ref": _git("rev-parse", ref), "wall_s": round(seconds), **measure(out, args)}
            if name == "after":  # uncommitted changes to the library or recipe would make "ref" a half truth
                run["uncommitted_changes"] = bool(_git("status", "--porcelain", "src", "recipes"))
            results["runs"][name] = run
            print(name, json.dumps(run), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
            f.write("\n")
    return results


if __name__ == "__main__":
    main()
