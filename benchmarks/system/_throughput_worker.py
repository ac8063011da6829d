"""One rank of a throughput job: DDP training steps of one model under several gradient-communication methods.

Launched by ``benchmarks/system/throughput.py`` with ``torchrun`` in every node of a testbed (one job per profile and
model), or directly for a quick local check::

    torchrun --standalone --nproc_per_node 2 benchmarks/system/_throughput_worker.py --model tiny-mlp --batch 4 \
        --methods fp32-sgdm birder-hierarchical --refs --out /tmp/throughput.jsonl

The machine is shared, and its load drifts by 2x within minutes, so the methods are measured *interleaved*: the
model is wrapped once in ``DistributedDataParallel`` (``init_sync=False``: every rank builds it from the same seed,
which spares BERT-Base's 440 MB broadcast) with one dispatching communication hook, and every step runs the next
method in turn: its hook (torch's ``allreduce_hook`` for fp32, ``fp16_compress_hook``, ``powerSGD_hook``,
``birder_hook``) and its optimizer. A warm-up round gives each method one step (PowerSGD two: one vanilla, one
compressed), then ``--rounds`` timed rounds follow, in alternating order (A..Z, Z..A), so that a load change hits
every method alike. A barrier starts every step on all ranks at once.

The three Birder methods share one ``Birder`` optimizer and one ``BirderHookState``, whose ``method`` (and
``topology``) is set before each of their steps: the same ``m`` and ``b`` and buffers, as one optimizer would have.

``--refs`` adds the no-communication references of the time breakdown, interleaved in the same rounds:
``ref-compute`` (a hook that returns the bucket untouched: forward, backward and the optimizer, no wire) and
``ref-fp16`` / ``ref-powersgd`` / ``ref-birder`` / ``ref-onebitadam`` (the hook on a one-rank process group: its
codec work, no wire).

Rank 0 appends one JSON line per method to ``--out``: step times (the slowest rank per step), samples/s over all
ranks, forward+backward and optimizer times, the bytes that crossed each node's inter-node interface during the
method's timed steps (the veth counters ``Testbed.link_bytes`` reads, from ``/proc/net/dev`` inside the
namespace) and, for Birder, its ``CommStats``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from birder_hf import Birder, BirderHookState, OneBitAdam, OneBitAdamHookState, Topology, birder_hook, onebit_adam_hook
from birder_hf.collectives import CommStats, onebit_all_reduce
from birder_hf.quantize import BitKeys
from birder_hf.settings import CommSettings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from throughput import METHODS  # noqa: E402  (the driver's list: stdlib-only module)

REFS = ("ref-compute", "ref-fp16", "ref-powersgd", "ref-birder", "ref-onebitadam")
MODELS = ("bert", "resnet50", "tiny-bert", "tiny-mlp")
# the optimizer the compressors (fp16, PowerSGD) run with: the paper's baseline for the model
PRIMARY_OPTIMIZER = {"bert": "adamw", "tiny-bert": "adamw", "resnet50": "sgdm", "tiny-mlp": "sgdm"}
POWERSGD_RANK = 4  # matrix_approximation_rank (higher => less compression, better approximation)


# ------------------------------------------------------------------------------------------------ models and data
def build_model(name: str, args) -> torch.nn.Module:
    torch.manual_seed(0)  # identical on every rank (DDP runs with init_sync=False)
    if name in ("bert", "tiny-bert"):
        from transformers import BertConfig, BertForQuestionAnswering

        if name == "bert":
            cfg = BertConfig()  # bert-base: 12 layers, hidden 768, 110M parameters
        else:
            cfg = BertConfig(
                vocab_size=1000,
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=128,
                max_position_embeddings=max(64, args.seq_len),
            )
        return BertForQuestionAnswering(cfg)
    if name == "resnet50":
        import timm

        return timm.create_model("resnet50", pretrained=False, num_classes=1000)
    if name == "tiny-mlp":  # 26k parameters: no transformers/timm import, the codec stays on its eager path
        return torch.nn.Sequential(
            torch.nn.Linear(64, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 10),
        )
    raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")


def build_batch(name: str, args, rank: int):
    g = torch.Generator().manual_seed(1000 + rank)
    b = args.batch
    if name in ("bert", "tiny-bert"):
        vocab = 30522 if name == "bert" else 1000
        return {
            "input_ids": torch.randint(0, vocab, (b, args.seq_len), generator=g),
            "attention_mask": torch.ones(b, args.seq_len, dtype=torch.long),
            "token_type_ids": torch.zeros(b, args.seq_len, dtype=torch.long),
            "start_positions": torch.randint(0, args.seq_len, (b,), generator=g),
            "end_positions": torch.randint(0, args.seq_len, (b,), generator=g),
        }
    if name == "resnet50":
        return {
            "x": torch.randn(b, 3, args.image_size, args.image_size, generator=g),
            "y": torch.randint(0, 1000, (b,), generator=g),
        }
    return {"x": torch.randn(b, 64, generator=g), "y": torch.randint(0, 10, (b,), generator=g)}


def loss_fn(name: str, model, batch) -> torch.Tensor:
    if name in ("bert", "tiny-bert"):
        return model(**batch).loss
    return F.cross_entropy(model(batch["x"]), batch["y"])


def build_optimizer(kind: str, params):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01)
    if kind == "sgdm":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, weight_decay=1e-4)
    if kind == "birder":
        return Birder(params, lr=1e-4, beta=0.95, weight_decay=0.1, seed=0)  # the seed README's beta / wd
    if kind == "onebitadam":  # one full-precision warm-up step (the warm-up round), compressed from then on
        return OneBitAdam(params, lr=1e-5, weight_decay=0.01, freeze_step=1)
    raise ValueError(kind)


# ---------------------------------------------------------------------------------------------------------- hooks
class Dispatch:
    """State of :func:`dispatch_hook`: the hook (and its state) of the method the next step runs, and the step's
    timeline (``events``: per bucket, seconds since the step began at the hook's call, at its return and when its
    Future was done)."""

    def __init__(self):
        self.hook, self.state = None, None
        self.t0, self.events = 0.0, []


def dispatch_hook(d, bucket):  # unannotated: DDP rejects the string annotations of `from __future__`
    t_in = time.perf_counter() - d.t0
    fut = d.hook(d.state, bucket)
    ev = {"bucket": bucket.index(), "numel": bucket.buffer().numel(), "call": t_in, "ret": time.perf_counter() - d.t0}
    d.events.append(ev)
    fut.add_done_callback(lambda _: ev.__setitem__("done", time.perf_counter() - d.t0))
    return fut


def nocomm_hook(_, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class Chain:
    """Runs a communication hook's buckets one after another, in bucket order, on every rank.

    PowerSGD issues its second and third all-reduces from completion callbacks. On gloo those run on the backend's
    threads, so with two buckets in flight the ranks can issue them in different orders and gloo fails ("Received
    data size doesn't match expected size"). NCCL runs one communicator's collectives in issue order anyway, so
    this keeps the hook's behaviour; each bucket's communication still overlaps the rest of backward.
    """

    def __init__(self, hook, state):
        self.hook, self.state, self.tail = hook, state, None


def _forward(src: torch.futures.Future, dst: torch.futures.Future) -> None:
    try:
        dst.set_result(src.value())
    except Exception as exc:  # handed to DDP, which re-raises it in backward
        dst.set_exception(exc)


def chained_hook(chain, bucket):
    prev = chain.tail
    if prev is None or prev.done():
        fut = chain.hook(chain.state, bucket)
    else:
        fut = torch.futures.Future()

        def start(_):
            try:
                chain.hook(chain.state, bucket).add_done_callback(lambda f: _forward(f, fut))
            except Exception as exc:
                fut.set_exception(exc)

        prev.add_done_callback(start)
    chain.tail = fut
    return fut


# ----------------------------------------------------------------------------------------------------------- arms
class Arm:
    """One method (or reference) of the interleaved measurement."""

    def __init__(self, name, hook, state, opt, opt_kind, birder=None, powersgd=None):
        self.name, self.hook, self.state, self.opt, self.opt_kind = name, hook, state, opt, opt_kind
        self.birder = birder  # (method, topology) to set on the shared BirderHookState
        self.powersgd = powersgd
        self.fwd_bwd: list[list[float]] = []  # per timed step, this rank
        self.opt_s: list[float] = []
        self.cpu: list[float] = []  # CPU seconds of this process (all threads: main, autograd, gloo) per timed step
        self.link = [0, 0]  # rx, tx bytes during the timed steps
        self.comm = {}  # CommStats deltas summed over the timed steps
        self.timeline = None  # this rank's last timed step: backward end, step end, the buckets' events


def build_arms(names, model_name, ddp, topo, solo_group, solo_topo):
    primary = PRIMARY_OPTIMIZER[model_name]
    opts: dict[str, torch.optim.Optimizer] = {}

    def opt(kind):
        if kind not in opts:
            opts[kind] = build_optimizer(kind, ddp.parameters())
        return opts[kind]

    birder_state = None
    arms = []
    for name in names:
        base = name.removeprefix("ref-")
        group = solo_group if name.startswith("ref-") else None  # None: the default group (all ranks)
        if name == "ref-compute":
            arms.append(Arm(name, nocomm_hook, None, opt(primary), primary))
        elif base.startswith("fp32-"):
            kind = base.split("-", 1)[1]
            arms.append(Arm(name, default_hooks.allreduce_hook, None, opt(kind), kind))
        elif base == "fp16":
            arms.append(Arm(name, default_hooks.fp16_compress_hook, group, opt(primary), primary))
        elif base == "powersgd":
            # start_powerSGD_iter=2 is the minimum error feedback allows; the warm-up round makes the first call
            # vanilla (DDP's buckets are final after it) and compresses from the second one on
            st = psgd.PowerSGDState(
                process_group=group, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=2, random_seed=0
            )
            arms.append(Arm(name, chained_hook, Chain(psgd.powerSGD_hook, st), opt(primary), primary, powersgd=st))
        elif base.startswith("birder"):
            if birder_state is None:
                birder_state = BirderHookState(opt("birder"), topology=topo, method="allgather")
            method = "allgather" if name == "ref-birder" else base.split("-", 1)[1]
            where = solo_topo if name == "ref-birder" else topo
            arms.append(Arm(name, birder_hook, birder_state, opt("birder"), "birder", birder=(method, where)))
        elif base == "onebitadam":  # its own optimizer per arm: a OneBitAdam serves one hook state
            onebit = build_optimizer("onebitadam", ddp.parameters())
            state = OneBitAdamHookState(onebit, topology=solo_topo if name.startswith("ref-") else topo)
            arms.append(Arm(name, onebit_adam_hook, state, onebit, "onebitadam"))
        else:
            raise ValueError(f"unknown method {name!r}; choose from {METHODS + REFS}")
    return arms


# ------------------------------------------------------------------------------------------------------- measuring
def link_counters() -> tuple[int, int] | None:
    """(rx, tx) bytes of this namespace's inter-node interface (``GLOO_SOCKET_IFNAME``), or None off a testbed."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if not ifname or ifname == "lo":
        return None
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        if name.strip() == ifname:
            fields = rest.split()
            return int(fields[0]), int(fields[8])
    return None


def step(arm: Arm, dispatch: Dispatch, model_name: str, module, batch, timed: bool) -> None:
    dispatch.hook, dispatch.state = arm.hook, arm.state
    if arm.birder is not None:
        method, arm.state.topology = arm.birder
        arm.state.comm_settings = CommSettings(method)
    stats = arm.state.stats.as_dict("") if isinstance(arm.state, (BirderHookState, OneBitAdamHookState)) else None
    # every rank starts the step together: otherwise the previous method's skew (one rank still decoding its last
    # bucket) would be timed as this method's waiting
    dist.barrier()
    link0 = link_counters() if timed else None
    c0 = time.process_time()
    t0 = dispatch.t0 = time.perf_counter()
    dispatch.events = []
    arm.opt.zero_grad(set_to_none=True)
    loss_fn(model_name, module, batch).backward()  # DDP: returns once every bucket's future is done
    t1 = time.perf_counter()
    arm.opt.step()
    t2 = time.perf_counter()
    c1 = time.process_time()
    if arm.powersgd is not None and arm.powersgd.iter < arm.powersgd.start_powerSGD_iter:
        arm.powersgd.iter = arm.powersgd.start_powerSGD_iter  # see build_arms
    if not timed:
        return
    arm.fwd_bwd.append(t1 - t0)
    arm.opt_s.append(t2 - t1)
    arm.timeline = {"backward_end": t1 - t0, "step_end": t2 - t0, "buckets": dispatch.events}
    arm.cpu.append(c1 - c0)
    if link0 is not None:
        link1 = link_counters()
        arm.link = [arm.link[0] + link1[0] - link0[0], arm.link[1] + link1[1] - link0[1]]
    if stats is not None:
        after = arm.state.stats.as_dict("")
        for k, v in after.items():
            if k != "compression_ratio":
                arm.comm[k] = arm.comm.get(k, 0) + v - stats[k]


def analytic_bytes(method: str, numel: int, world: int) -> int | None:
    """What a ring all-reduce sends per rank: 2(n-1)/n x the payload (fp32: 4 bytes per value, fp16: 2)."""
    if method.startswith("fp32"):
        return round(2 * (world - 1) * 4 * numel / world)
    if method == "fp16":
        return round(2 * (world - 1) * 2 * numel / world)
    return None


def report(arm: Arm, topo: Topology, args, world: int, numel: int) -> dict:
    mine = {
        "node": topo.node_rank,
        "local_rank": topo.local_rank,
        "fwd_bwd": arm.fwd_bwd,
        "opt": arm.opt_s,
        "cpu": arm.cpu,
        "link": arm.link if link_counters() is not None else None,
        "timeline": arm.timeline,
    }
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    n = len(arm.fwd_bwd)
    # the slowest rank per step (DDP keeps ranks in lock step; the difference is the skew at the last bucket)
    steps = [max(r["fwd_bwd"][i] + r["opt"][i] for r in ranks) for i in range(n)]
    mean = sum(steps) / n
    per_node = {}
    for r in ranks:
        if r["local_rank"] == 0 and r["link"] is not None:
            per_node[r["node"]] = {"rx_bytes_per_step": r["link"][0] / n, "tx_bytes_per_step": r["link"][1] / n}
    rec = {
        "kind": "method",
        "method": arm.name,
        "optimizer": arm.opt_kind,
        "timed_steps": n,
        "step_s": steps,
        "step_s_mean": mean,
        "step_s_median": sorted(steps)[n // 2] if n % 2 else sum(sorted(steps)[n // 2 - 1 : n // 2 + 1]) / 2,
        "samples_per_s": (1 if arm.name.startswith("ref-") else world) * args.batch / mean,
        "fwd_bwd_s": sum(max(r["fwd_bwd"][i] for r in ranks) for i in range(n)) / n,
        "opt_s": sum(max(r["opt"][i] for r in ranks) for i in range(n)) / n,
        # CPU work per step (the busiest rank): what a step costs when every rank has its own core; the wall time
        # above also holds the time spent waiting for a core on this shared machine, and for the network
        "cpu_s": sum(max(r["cpu"][i] for r in ranks) for i in range(n)) / n,
        "cpu_steps_s": [max(r["cpu"][i] for r in ranks) for i in range(n)],
        "link_per_node": per_node or None,
        "inter_node_tx_bytes_per_step": (sum(v["tx_bytes_per_step"] for v in per_node.values()) / len(per_node))
        if per_node
        else None,
        "commstats_per_step": {k: v / n for k, v in arm.comm.items()} if arm.comm else None,
        "analytic_bytes_per_rank": analytic_bytes(arm.name, numel, world),
        "timeline_last_step": [r["timeline"] for r in ranks],  # per rank
    }
    if rec["commstats_per_step"]:
        cs = rec["commstats_per_step"]
        sent = cs["intra_node_bytes"] + cs["inter_node_bytes"]
        cs["compression_ratio"] = cs["fp32_allreduce_bytes"] / sent if sent else None
    if arm.powersgd is not None:
        rate, before, after = arm.powersgd.compression_stats()
        rec["powersgd"] = {"rank": POWERSGD_RANK, "compress_rate": rate, "numel_before": before, "numel_after": after}
    return rec


def top_ops(arm: Arm, dispatch: Dispatch, model_name: str, module, batch, k: int = 15) -> list[dict]:
    """Self CPU time of the busiest operators over one more step of ``arm`` (rank 0's view)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(arm, dispatch, model_name, module, batch, timed=False)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:k]
    return [{"op": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6} for e in rows]


def time_copy(numel: int, repeats: int = 3) -> float:
    """Median seconds per element of one fp32 ``copy_`` (of up to 2^24 values), every rank at once: the
    memory-bandwidth yardstick that ``cost_model.py`` measures the codec against."""
    numel = min(numel, 1 << 24)
    src = torch.randn(numel)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] / numel


def release_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise): the machine's memory is shared."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def warm_codec(solo_topo: Topology, numel: int) -> None:
    """Compile the codec kernels (torch.compile, once per process) before anything is timed.

    Sized like the model (at most 2^17 elements), in two segments as a bucket of parameters is.
    """
    half = max(8, min(1 << 16, numel // 2))
    u = torch.rand(2 * half) * 2 - 1
    keys = BitKeys(0, 1, [0, 1], [half, half])  # two segments: the per-parameter path of a bucket
    for method in ("allgather", "scatter_gather", "hierarchical"):
        onebit_all_reduce(u, topology=solo_topo, method=method, keys=keys, stats=CommStats())
        onebit_all_reduce(u, topology=solo_topo, method=method, keys=7)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=MODELS, required=True)
    ap.add_argument("--batch", type=int, nargs="+", required=True, help="samples per process per step (in turn)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--refs", nargs="*", default=None, choices=REFS, help="no-communication references (all if bare)")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds (each method one step per round)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--profile-ops", action="store_true", help="record the top operators of one ref-birder step")
    ap.add_argument("--tag", default="", help="JSON object merged into every record (the driver's context)")
    ap.add_argument("--out", required=True, help="JSON lines, appended by rank 0")
    args = ap.parse_args(argv)
    refs = [] if args.refs is None else (list(args.refs) or list(REFS))

    torch.set_num_threads(args.threads)
    own_group = not dist.is_initialized()  # under torchrun; a test may have initialized it already
    if own_group:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_env() if "LOCAL_WORLD_SIZE" in os.environ else Topology.flat()
    solo_group, _ = dist.new_subgroups(group_size=1)
    solo_topo = Topology.flat(solo_group)
    tag = json.loads(args.tag) if args.tag else {}
    t_start = time.perf_counter()

    model = build_model(args.model, args)
    model.train()
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # init_sync=False relies on identical initial weights: check a fingerprint instead of broadcasting them
    with torch.no_grad():
        fp = torch.stack([p.double().sum() for p in model.parameters()]).sum().reshape(1)
    fps = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(fps, fp)
    if any(not torch.equal(f, fps[0]) for f in fps):
        raise RuntimeError("ranks built different initial weights; init_sync=False needs the same seed everywhere")
    warm_codec(solo_topo, numel)
    copy_s_per_elem = time_copy(numel)
    release_memory()
    ddp = DDP(model, init_sync=False, gradient_as_bucket_view=True)
    dispatch = Dispatch()
    ddp.register_comm_hook(dispatch, dispatch_hook)
    names = refs + list(args.methods)
    arms = build_arms(names, args.model, ddp, topo, solo_group, solo_topo)
    batches = list(args.batch)

    def emit(rec: dict) -> None:
        if rank != 0:
            return
        rec = {**tag, **rec, "model": args.model, "batch_per_proc": args.batch, "world_size": world}
        rec.update(nodes=topo.num_nodes, procs_per_node=topo.local_world_size, numel=numel)
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def progress(msg: str) -> None:  # a line for the driver's live log (and stdout)
        if rank == 0:
            print(f"[throughput] {tag.get('profile', 'local')} {args.model} b{args.batch} {msg}", flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps({"kind": "progress", "batch_per_proc": args.batch, "msg": msg}) + "\n")

    for b in batches:
        args.batch = b
        batch = build_batch(args.model, args, rank)
        for arm in arms:
            arm.fwd_bwd, arm.opt_s, arm.cpu, arm.link, arm.comm = [], [], [], [0, 0], {}
        t0 = time.perf_counter()
        load0 = os.getloadavg()[0]
        # warm-up round: every method once (PowerSGD twice: one vanilla step, one compressed)
        for arm in arms:
            for _ in range(2 if arm.powersgd is not None and arm.powersgd.iter == 0 else 1):
                step(arm, dispatch, args.model, ddp, batch, timed=False)
        progress(f"warm-up round {time.perf_counter() - t0:.0f} s")
        for r in range(args.rounds):
            for arm in arms if r % 2 == 0 else arms[::-1]:
                step(arm, dispatch, args.model, ddp, batch, timed=True)
            progress(f"round {r + 1}/{args.rounds} done at {time.perf_counter() - t0:.0f} s")
        ops = None
        if args.profile_ops and "ref-birder" in names:
            ops = top_ops(arms[names.index("ref-birder")], dispatch, args.model, ddp, batch)
        emit(
            {
                "kind": "meta",
                "torch": torch.__version__,
                "python": platform.python_version(),
                "threads_per_rank": args.threads,
                "seq_len": args.seq_len if "bert" in args.model else None,
                "image_size": args.image_size if args.model == "resnet50" else None,
                "topology": repr(topo),
                "setup_s": t0 - t_start,
                "measure_s": time.perf_counter() - t0,
                "rounds": args.rounds,
                "order": names,
                "copy_s_per_elem": copy_s_per_elem,  # one fp32 copy_ (memory-bandwidth yardstick for the codec)
                "loadavg_1min": [load0, os.getloadavg()[0]],
                "top_ops_ref_birder": ops,
            }
        )
        for arm in arms:
            emit(report(arm, topo, args, world, numel))
    dist.barrier()
    if own_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
