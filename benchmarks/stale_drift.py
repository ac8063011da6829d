"""Stale-direction drift (issue 25): how far a coordinate moves after its gradient stops, and how many coordinates of
the time-to-accuracy tasks have an exactly-zero gradient on a step (the ones ``Birder``'s ``stale`` modes act on).

1. ``drift``: the issue's example. ``Birder([p], lr=1e-3)``, gradient (1, -1, 0.5, 0) at step 0 and zeros after;
   |p_t - p_0| / lr after 20, 200 and 1000 steps, for the paper's literal update (``stale="keep"``), ``amsgrad=True``,
   ``stale="lazy"``, both, and ``stale="fade"`` (the default): in one process, and on 4 real ranks (2 nodes x 2,
   gloo) with the DDP hook and ``hierarchical``, every rank giving that gradient scaled by (1 + rank).
2. ``zeros``: each task of ``benchmarks/system/tta.py`` (its model, batch and data, one rank's batches of steps
   1..``--steps`` of seed 0, trained by ``Birder`` at the task's tuned lr in this one process): the share of
   gradient elements that are exactly 0 on each step, in all and per parameter (the 5 with the most).

    python benchmarks/stale_drift.py --out docs/results/stale_drift.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks" / "system"))
sys.path.insert(0, str(ROOT / "benchmarks"))  # provenance.py

from provenance import provenance  # noqa: E402

from birder_hf import Birder, Topology, attach_ddp_hook  # noqa: E402

VARIANTS = {
    "literal": {"stale": "keep", "amsgrad": False},
    "amsgrad": {"stale": "keep", "amsgrad": True},
    "lazy": {"stale": "lazy", "amsgrad": False},
    "both": {"stale": "lazy", "amsgrad": True},
    "fade": {"stale": "fade", "amsgrad": False},
}
G0 = (1.0, -1.0, 0.5, 0.0)
CHECKPOINTS = (20, 200, 1000)
LR = 1e-3


def _drift_one_process(options: dict) -> dict:
    p = torch.nn.Parameter(torch.zeros(4))
    opt = Birder([p], lr=LR, seed=0, **options)
    out = {}
    for t in range(1, max(CHECKPOINTS) + 1):
        p.grad = torch.tensor(G0) if t == 1 else torch.zeros(4)
        opt.step()
        if t in CHECKPOINTS:
            out[t] = [round(v / LR, 3) for v in p.detach().abs().tolist()]
    return out


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))

    def forward(self, c):
        return (self.w * c).sum()


def _drift_ddp(rank, world, variants):
    from torch.nn.parallel import DistributedDataParallel as DDP

    topo = Topology.from_layout(2, 2)
    res = {}
    for name in variants:
        model = DDP(_Linear())
        opt = Birder(model.parameters(), lr=LR, seed=0, **VARIANTS[name])
        attach_ddp_hook(model, opt, topology=topo, method="hierarchical")
        out = {}
        for t in range(1, max(CHECKPOINTS) + 1):
            c = torch.tensor(G0) * (1 + rank) if t == 1 else torch.zeros(4)
            model(c).backward()
            opt.step()
            opt.zero_grad()
            if t in CHECKPOINTS:
                out[t] = [round(v / LR, 3) for v in model.module.w.detach().abs().tolist()]
        res[name] = out
    return res


def drift() -> dict:
    from _dist import run_distributed

    one = {name: _drift_one_process(opts) for name, opts in VARIANTS.items()}
    ddp = run_distributed(_drift_ddp, 4, list(VARIANTS), timeout=600)
    assert all(r == ddp[0] for r in ddp), "replicas differ"
    return {"one_process": one, "ddp_hook_4_ranks_2x2_hierarchical": ddp[0]}


def zeros(tasks, steps: int, work: Path) -> dict:
    import torch.distributed as dist
    from _tta_worker import build_task

    out = {}
    init = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{init.name}", rank=0, world_size=1)
    try:
        for task_name in tasks:
            batch = {"qa": 8, "image": 8, "lm": 4}[task_name]
            args = argparse.Namespace(seed=0, batch=batch, qa_train=2400, qa_eval=240)
            # one rank of the protocol's 4: world 4 for the batch indices, this process plays rank 0
            task = build_task(task_name, args, 0, 4, work)
            model = task.model
            lr = json.loads((ROOT / "docs/results/tta.json").read_text())["tuned"][task_name]["birder-h"]["lr"]
            opt = Birder(model.parameters(), lr=lr, weight_decay=0.1 if task_name == "image" else 0.01, seed=0)
            per_param, per_step = {n: [0, 0] for n, _ in model.named_parameters()}, []
            for step in range(1, steps + 1):
                model.zero_grad(set_to_none=True)
                task.loss(model, task.batch(step)).backward()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                per_step.append(round(sum(int((g == 0).sum()) for g in grads) / sum(p.numel() for p in grads), 5))
                opt.step()
                for n, p in model.named_parameters():
                    if p.grad is not None:
                        per_param[n][0] += int((p.grad == 0).sum())
                    per_param[n][1] += p.numel()  # no .grad at all counts as all zero
                    if p.grad is None:
                        per_param[n][0] += p.numel()
            total_zero = sum(z for z, _ in per_param.values())
            total = sum(n for _, n in per_param.values())
            top = sorted(per_param.items(), key=lambda kv: -kv[1][0])[:5]
            out[task_name] = {
                "steps": steps,
                "batch_per_rank": batch,
                "params": total // steps,
                "lr": lr,
                "zero_share": total_zero / total,
                "zero_share_per_step": per_step,
                "largest": {n: {"zero_share": z / t, "numel": t // steps} for n, (z, t) in top if z},
            }
            print(task_name, json.dumps(out[task_name]), flush=True)
    finally:
        dist.destroy_process_group()
        Path(init.name).unlink(missing_ok=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--tasks",
        nargs="*",
        default=["qa", "lm", "image"],
        help="tasks whose zero-gradient share to measure (none: keep the shares stored in --out)",
    )
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--work", type=Path, default=ROOT / "outputs" / "tta_stale" / "data")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result = {**provenance(__file__, argv), "lr": LR,
              "gradient_at_step_1": G0, "drift_in_lr": drift()}  # fmt: skip
    print(json.dumps(result["drift_in_lr"], indent=1), flush=True)
    if args.tasks:
        result["zero_gradient_share"] = zeros(args.tasks, args.steps, args.work)
    elif args.out and args.out.exists():
        old = json.loads(args.out.read_text())
        result["zero_gradient_share"] = old.get("zero_gradient_share")
        result["zero_gradient_share_command"] = old.get("zero_gradient_share_command", old.get("command"))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
