"""Where the Birder hook's CPU time goes, phase by phase, for a model's gradient (one thread, no communication).

    python benchmarks/hook_phases.py --model bert --out docs/results/hook_phases.json

Splits the codec work that ``throughput.py`` measures as one "codec" bar into the passes the hook and the optimizer
make over the gradient (DDP's 25 MiB buckets of the model's real parameter shapes, random values), each timed side
by side with an fp32 ``copy_`` of the same buffers (the memory-bandwidth yardstick), and next to a cheaper
variant of the same computation, to show what a change in ``src/`` would save:

- finite check: the hook's ``~torch.isfinite(buffer).all()`` vs ``torch.isfinite(buffer.sum())``;
- encode (m, b, u): ``optim._single_tensor_encode`` vs the same arithmetic fused by ``torch.compile``;
- quantize + pack: ``BitKeys.quantize_pack`` over the bucket's per-parameter segments vs one segment;
- 1-bit all-reduce on one rank (quantize, count, decode) via ``onebit_all_reduce``;
- apply: ``optim._apply_update`` (``x += -lr (d + wd x)``) vs ``x.mul_(1 - lr wd).add_(d, alpha=-lr)``;
- for scale: AdamW's and SGDM's ``step()`` over the same parameters.

Private functions are looked up by name; a phase whose function is gone is skipped (the codec is being reworked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from codec import median_seconds as _time  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from birder_hf import Topology  # noqa: E402
from birder_hf import optim as birder_optim  # noqa: E402
from birder_hf.collectives import onebit_all_reduce  # noqa: E402
from birder_hf.quantize import BitKeys  # noqa: E402

BUCKET_BYTES = 25 * 2**20


def _shapes(model: str) -> list[torch.Size]:
    if model == "bert":
        from transformers import BertConfig, BertForQuestionAnswering

        m = BertForQuestionAnswering(BertConfig())
    elif model == "resnet50":
        import timm

        m = timm.create_model("resnet50", num_classes=1000)
    else:
        raise ValueError(model)
    return [p.shape for p in m.parameters()]


def run(model: str, repeats: int) -> dict:
    torch.set_num_threads(1)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    topo = Topology.flat()
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g) for s in _shapes(model)]
    numel = sum(p.numel() for p in params)
    grads = [torch.randn(p.shape, generator=g) for p in params]
    # DDP's buckets: parameters in reverse order, ~25 MiB each
    buckets, cur, size = [], [], 0
    for i in reversed(range(len(params))):
        cur.append(i)
        size += params[i].numel() * 4
        if size >= BUCKET_BYTES:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    flat = [torch.cat([grads[i].reshape(-1) for i in b]) for b in buckets]
    dst = [torch.empty_like(f) for f in flat]
    us = [torch.rand(f.shape, generator=g) * 2 - 1 for f in flat]
    keys = [BitKeys(0, 1, list(b), [params[i].numel() for i in b]) for b in buckets]
    ms = [torch.zeros_like(p) for p in params]
    bs = [torch.rand_like(p) for p in params]
    mo, bo, uo = ([torch.empty_like(p) for p in params] for _ in range(3))

    phases: dict[str, float] = {}
    phases["copy_ (yardstick)"] = _time(lambda: [d.copy_(f) for d, f in zip(dst, flat)], repeats)
    phases["finite check: isfinite(buf).all() [hook]"] = _time(
        lambda: [(~torch.isfinite(f).all()) for f in flat], repeats
    )
    phases["finite check: isfinite(buf.sum())"] = _time(lambda: [torch.isfinite(f.sum()) for f in flat], repeats)
    encode = getattr(birder_optim, "_single_tensor_encode", None)
    if encode is not None:
        phases["encode m, b, u: _single_tensor_encode [hook]"] = _time(
            lambda: encode(
                grads, ms, bs, None, beta=0.95, maximize=False, out=(mo, bo, [None] * len(params)), u_out=uo
            ),
            repeats,
        )

    def fused(g_, m_, b_, m_out, b_out, u_out):
        m_new = m_ * 0.95 + g_ * 0.05
        b_new = b_ * 0.95 + g_.abs() * 0.05
        m_out.copy_(m_new)
        b_out.copy_(b_new)
        u_out.copy_((m_new / b_new.clamp_min(1e-30)).clamp(-1, 1))

    compiled = torch.compile(fused, dynamic=True)
    phases["encode m, b, u: torch.compile fused"] = _time(
        lambda: [compiled(*t) for t in zip(grads, ms, bs, mo, bo, uo)], repeats
    )
    phases["quantize+pack: BitKeys, per-parameter segments [hook]"] = _time(
        lambda: [k.quantize_pack(u, 0, 0, 0) for k, u in zip(keys, us)], repeats
    )
    phases["quantize+pack: one segment"] = _time(
        lambda: [BitKeys(0, 1, [0], [u.numel()]).quantize_pack(u, 0, 0, 0) for u in us], repeats
    )
    phases["1-bit all-reduce on one rank (quantize, count, decode)"] = _time(
        lambda: [onebit_all_reduce(u, topology=topo, method="allgather", generator=k) for k, u in zip(keys, us)],
        repeats,
    )
    apply = getattr(birder_optim, "_apply_update", None)
    if apply is not None:
        phases["apply x -= lr (d + wd x): _apply_update [step]"] = _time(
            lambda: apply(params, grads, lr=1e-9, weight_decay=0.1), repeats
        )

    def apply_two_pass():
        for p, d in zip(params, grads):
            p.mul_(1 - 1e-9 * 0.1).add_(d, alpha=-1e-9)

    phases["apply: mul_ + add_ (two passes, no temporaries)"] = _time(apply_two_pass, repeats)
    for name, opt in (
        ("AdamW step (baseline, foreach)", torch.optim.AdamW),
        ("SGDM step (baseline, foreach)", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)),
    ):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        for p, gr in zip(ps, grads):
            p.grad = gr
        o = opt(ps)
        phases[name] = _time(o.step, repeats)
        del ps, o
    base = phases["copy_ (yardstick)"]
    return {
        "model": model,
        "numel": numel,
        "buckets": len(buckets),
        "threads": 1,
        "torch": torch.__version__,
        "loadavg_1min": os.getloadavg()[0],
        "ms": {k: round(v * 1e3, 1) for k, v in phases.items()},
        "copies": {k: round(v / base, 2) for k, v in phases.items()},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("bert", "resnet50"), default="bert")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="docs/results/hook_phases.json")
    args = ap.parse_args(argv)
    res = run(args.model, args.repeats)
    print(
        f"{args.model}: {res['numel']:,} parameters in {res['buckets']} buckets, one thread, "
        f"load average {res['loadavg_1min']:.1f}"
    )
    print("| phase | ms | x copy_ |\n|---|---:|---:|")
    for k in res["ms"]:
        print(f"| {k} | {res['ms'][k]:.0f} | {res['copies'][k]:.2f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
