"""How long a step Birder's vote makes at n workers and one global batch (issue 25, item 3: why quality per step
falls as n grows at a fixed global batch).

Birder's direction is ``d`` with ``E[d] = mean_i u_i`` (``u_i = m_i / b_i``, worker i's own EMAs). At a fixed global
batch B, worker i sees B / n samples per step: its gradient is noisier as n grows, ``b_i`` (the EMA of ``|g_i|``)
grows with the noise while ``m_i`` averages it out, so ``|u_i|`` and the expected step ``|E[d]| lr`` shrink. This
measures it on the time-to-accuracy QA task with ``simulate_quality``'s set-up (same model, data, schedule and
per-step samples for every n): every ``--every`` steps, over all coordinates, the mean of ``|mean_i u_i|`` (the
expected step per unit of lr) and of ``mean_i |u_i|``.

    python benchmarks/vote_strength.py --workers 2x2 2x4 4x8 8x8 --global-batch 64 --steps 100 --seed 3
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "system"))

from provenance import provenance  # noqa: E402
from simulate_quality import one_process_group, worker_grads  # noqa: E402
from simulate_workers import SimulatedWorkers  # noqa: E402


def measure(workers: str, args) -> list[dict]:
    from _tta_worker import build_task, lr_lambda

    nodes, local = map(int, workers.split("x"))
    n = nodes * local
    with one_process_group():
        ns = argparse.Namespace(seed=args.seed, batch=args.global_batch // n, qa_train=2400, qa_eval=240)
        task = build_task("qa", ns, 0, n, args.work / "data")
        params = list(task.model.parameters())
        sim = SimulatedWorkers(params, nodes, local, lr=args.lr, weight_decay=0.01, seed=args.seed)
        sched = torch.optim.lr_scheduler.LambdaLR(sim.optimizers[0], lr_lambda(args.schedule_steps))
        rows = []
        for step in range(1, args.steps + 1):
            sim.step(worker_grads(task, params, n, step)[0])
            sched.step()
            if step % args.every == 0:
                us = torch.stack(sim.last_us)
                rows.append({"step": step, "mean_abs_mean_u": us.mean(0).abs().mean().item(),
                             "mean_abs_u": us.abs().mean().item()})  # fmt: skip
                print(workers, rows[-1], flush=True)
        return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", nargs="+", default=["2x2", "2x4", "4x8", "8x8"])
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--schedule-steps", type=int, default=600, help="the run whose schedule steps 1..--steps follow")
    ap.add_argument("--every", type=int, default=25)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--work", type=Path, default=ROOT / "outputs" / "simulate_quality")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "vote_strength_qa.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {**provenance(__file__, argv),
           "global_batch": args.global_batch, "lr": args.lr, "seed": args.seed, "runs": {}}  # fmt: skip
    for workers in args.workers:
        n = math.prod(map(int, workers.split("x")))
        res["runs"][workers] = {"n": n, "batch_per_worker": args.global_batch // n, "rows": measure(workers, args)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
