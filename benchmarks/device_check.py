"""GPU device check: codec kernels, the Birder hook's cost on BERT-Base and ResNet-50, and peak memory, on one GPU.

    python benchmarks/device_check.py --out docs/results/gpu.json        # on a CUDA machine (~2 min on an H200)
    python benchmarks/device_check.py --device cpu --tiny --out /tmp/g.json   # CPU smoke test of the same code
    bash benchmarks/device_check.sh                                      # the gpu test suite, then this

What it measures (``docs/BENCHMARKS.md``, "GPU", says what each field of the JSON means):

- codec: quantize + pack and the decode kernels against ``copy_`` of the same fp32 tensor (25M and 110M elements),
  compiled (Triton) and eager. GPU time comes from CUDA events around a call queued behind ``torch.cuda._sleep``,
  so the launch overhead (host time, reported beside it) does not count; median of ``--repeats``.
  Target: quantize + pack <= 2x copy.
- hook: one GPU, DDP with world size 1 on NCCL (no network: the codec's and the bookkeeping's cost), plain DDP
  (fp32 all-reduce) + AdamW against DDP + ``birder_hook`` + Birder. BERT-Base QA (seq 128, batch 32, TF32 by default)
  and timm ResNet-50 (batch 128, channels_last, bf16 autocast). Rounds interleave the two (A B B A), each step timed
  with CUDA events; medians. Target: Birder's step <= 1.05x. ``codec_copies`` expresses the extra time in fp32
  copies of the model's gradient (timed in the same run): the unit ``benchmarks/cost_model.py`` reads.
- memory: peak and steady ``torch.cuda.memory_allocated`` of a fresh DDP model with AdamW, and with Birder + hook
  (m, b and the hook's second m, b: 8 bytes per parameter more than AdamW's two moments).

Each section's failure is recorded under ``errors`` and the others still run; the JSON is rewritten after each
section, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from birder_hf import Birder, BirderHookState, birder_hook
from birder_hf import quantize as Q

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402

SCHEMA = 1
SECTIONS = ("codec", "hook", "memory")
MODELS = ("bert", "resnet50")
CODEC_KERNELS = ("copy_ fp32", "quantize+pack", "unpack", "mean of 4 votes", "signs", "requantize 4 votes")
TARGETS = {"quantize+pack_vs_copy": 2.0, "hook_overhead_pct": 5.0}
_MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help="small sizes and models: a smoke test of the code paths")
    ap.add_argument("--out", default="docs/results/gpu.json")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--codec-numel", type=int, nargs="+", help="default 25M and 110M (tiny: 40k, eager kernels)")
    ap.add_argument("--repeats", type=int, help="codec timings per kernel (default 30; tiny 3)")
    ap.add_argument("--steps", type=int, help="timed steps per method (default 24; tiny 2)")
    ap.add_argument("--warmup", type=int, help="untimed steps per method first (default 6; tiny 1)")
    ap.add_argument("--bert-precision", choices=("fp32", "tf32", "bf16"), default="tf32")
    ap.add_argument("--junit", help="pytest's junit XML of the gpu suite, summarized under 'tests'")
    args = ap.parse_args(argv)
    tiny = args.tiny
    args.device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    args.codec_numel = args.codec_numel or ([40_001] if tiny else [25_000_000, 110_000_000])
    args.repeats = args.repeats or (3 if tiny else 30)
    args.steps = args.steps or (2 if tiny else 24)
    args.warmup = args.warmup if args.warmup is not None else (1 if tiny else 6)
    return args


# ------------------------------------------------------------------------------------------------------ environment
def environment(device: torch.device) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "type": device.type,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    for name in ("triton", "transformers", "timm", "accelerate", "pytest"):
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # the sections that need it record their error
            env[name] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(
            name=p.name,
            capability=f"{p.major}.{p.minor}",
            memory_GiB=round(p.total_memory / 2**30, 1),
            multiprocessors=p.multi_processor_count,
            nccl=".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
            device_count=torch.cuda.device_count(),
        )
    else:
        env["name"] = platform.processor() or platform.machine()
    with contextlib.suppress(Exception):
        head = Path(__file__).resolve().parents[1] / ".git" / "HEAD"
        ref = head.read_text().strip()
        env["git"] = (head.parent / ref[5:]).read_text().strip() if ref.startswith("ref: ") else ref
    return env


def junit_summary(path: str | None) -> dict | None:
    """Counts and the failing tests' names from pytest's junit XML (``None`` if there is none)."""
    if not path or not Path(path).exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": [], "skipped_reasons": {}}
    for s in suites:
        for key in ("tests", "failures", "errors", "skipped"):
            out[key] += int(s.get(key, 0))
        for case in s.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            for tag in ("failure", "error"):
                node = case.find(tag)
                if node is not None:
                    out["failed"].append(f"{name}: {(node.get('message') or '').splitlines()[0][:300]}")
            node = case.find("skipped")
            if node is not None:
                reason = (node.get("message") or "").splitlines()[0][:200]
                out["skipped_reasons"][reason] = out["skipped_reasons"].get(reason, 0) + 1
    out["passed"] = out["tests"] - out["failures"] - out["errors"] - out["skipped"]
    return out


# ----------------------------------------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device: torch.device, repeats: int, warmup: int = 2) -> tuple[float, float]:
    """(device ms, host ms): medians over ``repeats`` calls of ``fn`` after ``warmup`` (which compiles).

    On CUDA the stream is kept busy (``torch.cuda._sleep``) while ``fn`` is queued, so the events around it time
    its kernels back to back, not the launch overhead; host ms is the Python side of one call. On the CPU both
    are the wall time.
    """
    for _ in range(warmup):
        fn()
    _sync(device)
    host = []
    for _ in range(max(3, repeats // 4)):
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        _sync(device)
    if device.type != "cuda":
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            host.append(time.perf_counter() - t0)
        ms = statistics.median(host) * 1e3
        return ms, ms
    cycles = min(int(max(host) * 2 * 2.0e9) + 400_000, 400_000_000)  # twice the host time at ~2 GHz, >= ~0.2 ms
    pairs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    _sync(device)
    return statistics.median(s.elapsed_time(e) for s, e in pairs), statistics.median(host) * 1e3


# ------------------------------------------------------------------------------------------------------------ codec
def codec_section(args) -> list[dict]:
    records = []
    for i, numel in enumerate(args.codec_numel):
        for compiled in (True, False) if i == 0 else (True,):
            records.append(codec_record(numel, compiled, args))
            print(f"codec {numel:,} {'compiled' if compiled else 'eager'} done", flush=True)
    return records


def codec_record(numel: int, compiled: bool, args) -> dict:
    dev = args.device
    Q.set_codec_compile(compiled)
    try:
        g = torch.Generator().manual_seed(0)
        u = (torch.rand(numel, generator=g) * 2 - 1).to(dev)
        dst = torch.empty_like(u)
        key = Q.derive_key(0, 1)
        packed = Q.quantize_pack(u, key)
        votes = torch.stack([Q.quantize_pack(u, Q.derive_key(0, r)) for r in range(4)])  # 4 ranks' packed votes
        kernels = {
            "copy_ fp32": lambda: dst.copy_(u),
            "quantize+pack": lambda: Q.quantize_pack(u, key),
            "unpack": lambda: Q.unpack_bits(packed, numel),
            "mean of 4 votes": lambda: Q.votes_mean_(dst, votes),  # allgather's decode, into fp32
            "signs": lambda: Q.votes_mean_(dst, votes[:1]),  # scatter_gather's decode
            "requantize 4 votes": lambda: Q.requantize_pack(votes, key),  # a shard owner's count + draw + pack
        }
        times = {name: time_call(fn, dev, args.repeats) for name, fn in kernels.items()}
    finally:
        Q.set_codec_compile(True)
    copy_ms = times["copy_ fp32"][0]
    ratio = {k: round(v[0] / copy_ms, 3) for k, v in times.items()}
    return {
        "numel": numel,
        "compiled": compiled,
        "device_ms": {k: round(v[0], 4) for k, v in times.items()},
        "host_ms": {k: round(v[1], 4) for k, v in times.items()},
        "ratio_vs_copy": ratio,
        "copy_GBps": round(8 * numel / (copy_ms * 1e-3) / 1e9, 1),  # read 4 + write 4 bytes per element
        "target_quantize_pack_met": ratio["quantize+pack"] <= TARGETS["quantize+pack_vs_copy"],
    }


# ----------------------------------------------------------------------------------------------------- real models
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_one_rank_group(device: torch.device) -> None:
    """World size 1 (NCCL on CUDA, gloo on the CPU) on localhost: DDP runs, nothing crosses a network."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)


def build(name: str, args):
    """(model, batch, loss_fn, description) on ``args.device``, the model initialized from seed 0."""
    dev, tiny = args.device, args.tiny
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "bert":
        from transformers import BertConfig, BertForQuestionAnswering

        small = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
        cfg = BertConfig(**small) if tiny else BertConfig()
        model = BertForQuestionAnswering(cfg).to(dev)
        b, seq = (2, 16) if tiny else (32, 128)
        pos = torch.randint(0, seq, (2, b), generator=g)
        batch = {
            "input_ids": torch.randint(0, cfg.vocab_size, (b, seq), generator=g).to(dev),
            "attention_mask": torch.ones(b, seq, dtype=torch.long).to(dev),
            "start_positions": pos[0].to(dev),
            "end_positions": pos[1].to(dev),
        }
        bf16 = args.bert_precision == "bf16"

        def loss_fn(m, batch):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                return m(**batch).loss

        desc = {"batch": b, "seq": seq, "precision": args.bert_precision}
    else:
        import timm

        model = timm.create_model(
            "test_resnet" if tiny else "resnet50", pretrained=False, num_classes=10 if tiny else 1000
        )
        model = model.to(dev, memory_format=torch.channels_last)
        b, img = (2, 32) if tiny else (128, 224)
        x = torch.randn(b, 3, img, img, generator=g).to(dev).contiguous(memory_format=torch.channels_last)
        batch = {"x": x, "y": torch.randint(0, 10 if tiny else 1000, (b,), generator=g).to(dev)}

        def loss_fn(m, batch):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = m(batch["x"])
            return F.cross_entropy(logits.float(), batch["y"])

        desc = {"batch": b, "image": img, "precision": "bf16 autocast", "memory_format": "channels_last"}
    desc["model"] = f"{name} (tiny)" if tiny else name
    return model, batch, loss_fn, desc


class Arm:
    """One way to train the model: DDP + AdamW (fp32 all-reduce) or DDP + Birder hook."""

    def __init__(self, kind: str, model, loss_fn, device):
        self.kind, self.loss_fn = kind, loss_fn
        self.ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None)
        if kind == "adamw":
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
        else:
            self.opt = Birder(model.parameters(), lr=1e-5, weight_decay=0.01, seed=0)
            self.ddp.register_comm_hook(BirderHookState(self.opt), birder_hook)

    def step(self, batch) -> None:
        self.loss_fn(self.ddp, batch).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _timed_steps(arm: Arm, batch, n: int, device) -> list[float]:
    if device.type != "cuda":
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            arm.step(batch)
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    events = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        arm.step(batch)
        end.record()
        events.append((start, end))
    _sync(device)
    return [s.elapsed_time(e) for s, e in events]


def hook_record(name: str, args) -> dict:
    dev = args.device
    Q.set_codec_compile(not args.tiny)  # tiny: eager kernels, no compile time on a CPU
    if dev.type == "cuda" and name == "bert":
        tf32 = args.bert_precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32
    models = {}
    for kind in ("adamw", "birder"):
        model, batch, loss_fn, desc = build(name, args)
        models[kind] = Arm(kind, model, loss_fn, dev)
    numel = sum(p.numel() for p in models["birder"].ddp.parameters())
    times = {kind: [] for kind in models}
    for arm in models.values():  # warm-up: DDP's bucket rebuild, compiled codec, cuDNN plans
        for _ in range(args.warmup):
            arm.step(batch)
    half = max(1, args.steps // 2)
    for order in (("adamw", "birder"), ("birder", "adamw")):
        for kind in order:
            times[kind] += _timed_steps(models[kind], batch, half, dev)
    base, birder = statistics.median(times["adamw"]), statistics.median(times["birder"])
    del models
    release(dev)
    copy_ms = copy_time(numel, dev)
    copy_s_per_elem = copy_ms * 1e-3 / numel
    overhead = 100 * (birder / base - 1)
    return {
        **desc,
        "numel": numel,
        "world_size": 1,
        "backend": "nccl" if dev.type == "cuda" else "gloo",
        "baseline": "DDP fp32 all-reduce + AdamW",
        "birder": "DDP + birder_hook (allgather) + Birder",
        "timed_steps": len(times["birder"]),
        "adamw_step_ms": round(base, 3),
        "birder_step_ms": round(birder, 3),
        "adamw_steps_ms": [round(t, 3) for t in times["adamw"]],
        "birder_steps_ms": [round(t, 3) for t in times["birder"]],
        "overhead_pct": round(overhead, 2),
        "target_met": overhead <= TARGETS["hook_overhead_pct"],
        "copy_ms": round(copy_ms, 4),
        "copy_s_per_elem": copy_s_per_elem,
        "codec_copies": round((birder - base) * 1e-3 / numel / copy_s_per_elem, 3),
    }


def copy_time(numel: int, device) -> float:
    """Device ms of an fp32 ``copy_`` of ``numel`` elements: the yardstick ``codec_copies`` is expressed in."""
    src = torch.empty(numel, device=device)
    dst = torch.empty_like(src)
    return time_call(lambda: dst.copy_(src), device, 10)[0]


def release(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_record(name: str, args) -> dict:
    dev = args.device
    Q.set_codec_compile(not args.tiny)
    out = {}
    for kind in ("adamw", "birder"):
        release(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        model, batch, loss_fn, desc = build(name, args)
        arm = Arm(kind, model, loss_fn, dev)
        for _ in range(1 if args.tiny else 3):
            arm.step(batch)
        _sync(dev)
        tensors = [t for st in arm.opt.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
        rec = {"optimizer_state_MiB": round(sum(t.numel() * t.element_size() for t in tensors) / _MIB, 1)}
        if dev.type == "cuda":
            rec["peak_MiB"] = round((torch.cuda.max_memory_allocated(dev) - base) / _MIB, 1)
            rec["steady_MiB"] = round((torch.cuda.memory_allocated(dev) - base) / _MIB, 1)
        out[kind] = rec
        numel = sum(p.numel() for p in model.parameters())
        del arm, model, batch
    release(dev)
    rec = {**desc, "numel": numel, "adamw": out["adamw"], "birder": out["birder"]}
    rec["expected_birder_minus_adamw_MiB"] = round(8 * numel / _MIB, 1)  # the hook's second m and b (fp32 params)
    if dev.type == "cuda":
        rec["birder_minus_adamw_peak_MiB"] = round(out["birder"]["peak_MiB"] - out["adamw"]["peak_MiB"], 1)
        rec["birder_minus_adamw_steady_MiB"] = round(out["birder"]["steady_MiB"] - out["adamw"]["steady_MiB"], 1)
    return rec


# ------------------------------------------------------------------------------------------------------------ report
def table(result: dict) -> str:
    lines = []
    for rec in result.get("codec", []):
        mode = "compiled" if rec["compiled"] else "eager"
        lines.append(f"\ncodec, {rec['numel']:,} elements, {mode}  (copy_ {rec['copy_GBps']} GB/s)")
        lines.append(f"{'kernel':<22}{'device ms':>11}{'host ms':>10}{'x copy':>8}")
        for k in rec["device_ms"]:
            lines.append(
                f"{k:<22}{rec['device_ms'][k]:>11.4f}{rec['host_ms'][k]:>10.4f}{rec['ratio_vs_copy'][k]:>8.2f}"
            )
    if result.get("hook"):
        lines.append(f"\n{'hook, world size 1':<22}{'AdamW ms':>10}{'Birder ms':>11}{'overhead':>10}{'copies':>8}")
        for rec in result["hook"]:
            lines.append(
                f"{rec['model']:<22}{rec['adamw_step_ms']:>10.2f}{rec['birder_step_ms']:>11.2f}"
                f"{rec['overhead_pct']:>9.1f}%{rec['codec_copies']:>8.2f}"
            )
    if result.get("memory"):
        lines.append(f"\n{'memory (MiB)':<22}{'AdamW peak':>11}{'Birder peak':>12}{'state A/B':>14}{'8 B/param':>10}")
        for rec in result["memory"]:
            a, b = rec["adamw"], rec["birder"]
            lines.append(
                f"{rec['model']:<22}{a.get('peak_MiB', float('nan')):>11.0f}{b.get('peak_MiB', float('nan')):>12.0f}"
                f"{a['optimizer_state_MiB']:>7.0f}/{b['optimizer_state_MiB']:<6.0f}{rec['expected_birder_minus_adamw_MiB']:>10.0f}"
            )
    for section, err in result.get("errors", {}).items():
        lines.append(f"\n{section} FAILED: {err.strip().splitlines()[-1]}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "schema": SCHEMA,
        **provenance(__file__, argv),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tiny": args.tiny,
        "device": environment(args.device),
        "targets": TARGETS,
        "tests": junit_summary(args.junit),
        "errors": {},
    }

    def save():
        out.write_text(json.dumps(result, indent=1) + "\n")

    save()
    jobs = [("codec", None, codec_section)] if "codec" in args.only else []
    for section in ("hook", "memory"):
        if section in args.only:
            jobs += [(section, m, hook_record if section == "hook" else memory_record) for m in args.models]
    for section, model, fn in jobs:
        label = section if model is None else f"{section}/{model}"
        t0 = time.perf_counter()
        try:
            if model is None:
                result[section] = fn(args)
            else:
                init_one_rank_group(args.device)
                result.setdefault(section, []).append(fn(model, args))
        except Exception:
            result["errors"][label] = traceback.format_exc()
            release(args.device)
        except KeyboardInterrupt:  # device_check.sh's time limit sends SIGINT: keep what was measured
            result["errors"][label] = "interrupted (time limit)"
            save()
            break
        print(f"{label}: {time.perf_counter() - t0:.1f} s", flush=True)
        save()
    if dist.is_initialized():
        dist.destroy_process_group()
    print(table(result))
    print("wrote", out)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
