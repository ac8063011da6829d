"""The ranks of ``birder-hf preflight`` (see ``birder_hf.cli.preflight``): rendezvous, layout, backend, measurements.

Our tool, not part of the paper. Each rank joins a ``TCPStore`` on the master port (rank 0 hosts it, unless torchrun's
agent already does), all-gathers every rank's claimed layout through it, and fails on every rank at once when they
disagree (an ``abort`` key carries the first failure to all). Then it initialises the backend on that same store,
checks and times fp32 all-reduces on the intra-node, inter-node and world groups of ``Topology.from_layout``, runs a
1-bit hierarchical all-reduce, and rank 0 prints the report. Every stage is bounded: waits by ``--timeout``, and a
watchdog ends a stage that makes no progress.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import sys
import threading
import time

from .common import EXIT_CODES, Config, PreflightError, check_interfaces, emit, fail, node_checks

__all__ = ["run_rank", "render"]


@contextlib.contextmanager
def _stage(cfg: Config, check: str, seconds: float):
    """Run a stage; turn its errors into ``check`` failures, and end the process if it stalls for ``seconds``."""

    def stalled():
        fail(cfg, PreflightError(check, f"no progress for {seconds:.0f} s (a connection or collective hung)"))
        os._exit(EXIT_CODES[check])

    timer = threading.Timer(seconds, stalled)
    timer.daemon = True
    timer.start()
    try:
        yield
    except PreflightError:
        raise
    except Exception as exc:
        raise PreflightError(check, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    finally:
        timer.cancel()


def _ranges(ranks) -> str:
    ranks, out = sorted(ranks), []
    for r in ranks:
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def _judge(claims: list[dict]) -> tuple[str, str] | None:
    """The first disagreement among the ranks' claims, as ``(check, message)``; ``None`` if they agree."""
    layouts: dict[tuple, list[int]] = {}
    for c in claims:
        layouts.setdefault((c["nnodes"], c["nproc_per_node"]), []).append(c["rank"])
    if len(layouts) > 1:
        said = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {_ranges(rs)}: {k} node{'s' if k > 1 else ''} x {n} rank"
            f"{'s' if n > 1 else ''} per node"
            for (k, n), rs in sorted(layouts.items(), key=lambda kv: min(kv[1]))
        )
        fix = "pass every node the same --nnodes and --nproc_per_node (accelerate: num_machines, num_processes)"
        return "layout", f"ranks disagree on nodes x ranks per node ({said}); {fix}"
    by_rank: dict[int, list[dict]] = {}
    by_node: dict[int, set[str]] = {}
    for c in claims:
        by_rank.setdefault(c["rank"], []).append(c)
        by_node.setdefault(c["node_rank"], set()).add(c["host"])
    for rank, cs in sorted(by_rank.items()):
        if len(cs) > 1:
            hosts = ", ".join(sorted({c["host"] for c in cs}))
            return "layout", f"{len(cs)} processes claim rank {rank} (on {hosts}): give every node its own --node_rank"
    for node, hosts in sorted(by_node.items()):
        if len(hosts) > 1:
            what = f"node_rank {node} is claimed by several hosts ({', '.join(sorted(hosts))})"
            return "layout", f"{what}: give every node its own --node_rank"
    backends = {c["backend"] for c in claims}
    if len(backends) > 1:
        return "backend", f"ranks disagree on the backend ({', '.join(sorted(backends))}); pass --backend everywhere"
    return None


def _abort(store, check: str, message: str):
    if not store.check(["abort"]):
        store.set("abort", json.dumps([check, message]))
    raise PreflightError(*json.loads(store.get("abort")))


def _agree(store, cfg: Config, claim: dict) -> None:
    """All-gather every rank's claimed layout through the store; fail on every rank if they disagree."""
    world = cfg.nnodes * cfg.nproc_per_node
    deadline = time.monotonic() + 2 * cfg.timeout  # the nodes start within --timeout, then import torch
    store.set(f"member/{store.add('joined', 1)}", json.dumps(claim))
    table: list[dict] = []
    while True:
        if store.check(["abort"]):
            raise PreflightError(*json.loads(store.get("abort")))
        for i in range(len(table) + 1, store.add("joined", 0) + 1):
            table.append(json.loads(store.get(f"member/{i}")))
        problem = _judge(table)
        if problem:
            _abort(store, *problem)
        missing = sorted(set(range(world)) - {c["rank"] for c in table})
        if not missing:
            break
        if time.monotonic() > deadline:
            nodes = sorted({r // cfg.nproc_per_node for r in missing})
            _abort(
                store,
                "rendezvous",
                f"ranks {_ranges(missing)} (node{'s' if len(nodes) > 1 else ''} {_ranges(nodes)}) did not join within "
                f"{2 * cfg.timeout:.0f} s: start preflight on every node within --timeout of each other, with the "
                "same --master_addr/--master_port and each its own --node_rank; the missing nodes' output says why",
            )
        time.sleep(0.1)
    store.add("agreed", 1)
    while store.add("agreed", 0) < world:
        if store.check(["abort"]):
            raise PreflightError(*json.loads(store.get("abort")))
        if time.monotonic() > deadline + cfg.timeout:
            raise PreflightError("rendezvous", "a rank vanished after joining")
        time.sleep(0.05)


def _open_store(cfg: Config):
    from datetime import timedelta

    import torch.distributed as dist

    hosts = cfg.rank == 0 and not cfg.agent_store
    try:
        store = dist.TCPStore(
            cfg.master_addr, cfg.master_port, None, hosts, timedelta(seconds=cfg.timeout), wait_for_workers=False
        )
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if hosts:
            raise PreflightError("port", f"cannot listen on port {cfg.master_port} on node 0 ({first})") from exc
        raise PreflightError("reach", f"cannot connect to {cfg.master_addr}:{cfg.master_port} ({first})") from exc
    prefix = "birder_preflight"
    if cfg.agent_store:  # torchrun's store outlives restarts: keep each attempt's keys apart
        prefix += f"/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(prefix, store)


def _wait_for(store, key: str, count: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    with contextlib.suppress(Exception):
        while store.add(key, 0) < count and time.monotonic() < deadline:
            time.sleep(0.05)


def _init_backend(cfg: Config, backend: str, store):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    world = cfg.nnodes * cfg.nproc_per_node
    kwargs = {}
    if backend == "nccl":
        device = torch.device("cuda", cfg.local_rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device  # connect now, not at the first collective
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg", store),
        rank=cfg.rank,
        world_size=world,
        timeout=timedelta(seconds=cfg.timeout),
        **kwargs,
    )
    t = torch.ones(1, device=device)
    dist.all_reduce(t, async_op=True).wait(timedelta(seconds=cfg.timeout))
    if t.item() != world:
        raise PreflightError("collective", f"the first all-reduce returned {t.item()} instead of {world}")
    return device


def _timed(fn, device, iters: int) -> float:
    import torch

    times = []
    for i in range(iters + 1):  # the first call warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(cfg: Config, device) -> dict:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ..collectives import CommStats, expected_bytes, onebit_all_reduce
    from ..topology import Topology

    k, lws, rank = cfg.nnodes, cfg.nproc_per_node, cfg.rank
    world, wait = k * lws, timedelta(seconds=cfg.timeout)
    topo = Topology.from_layout(k, lws)
    groups = {
        "intra": (topo.intra_group, topo.intra_ranks, lws),
        "inter": (topo.inter_group, topo.inter_ranks, k),
        "world": (topo.world_group, range(world), world),
    }
    numel = max(1, int(cfg.size_mb * 1e6 / 4))
    try:
        big = torch.zeros(numel, device=device)
    except (RuntimeError, MemoryError) as exc:  # out of memory: no collective has failed
        what = f"--size_mb {cfg.size_mb:g} does not fit in memory here ({exc}); pass less"
        raise PreflightError("arguments", what) from exc
    seconds = {}
    for name, (group, ranks, size) in groups.items():
        if size == 1:
            continue
        check = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(check, group=group, async_op=True).wait(wait)
        expected = float(sum(r + 1 for r in ranks))
        if not bool((check == expected).all()):
            raise PreflightError(
                "collective", f"the {name} fp32 all-reduce returned {check[0].item()} instead of {expected}"
            )
        seconds[name] = _timed(
            lambda g=group: dist.all_reduce(big, group=g, async_op=True).wait(wait), device, cfg.iters
        )

    # 1-bit hierarchical all-reduce over both levels: the mean of u_r = (r + 0.5) / n over the ranks is exactly 0.5
    u = torch.full((cfg.onebit_numel,), (rank + 0.5) / world, device=device)
    stats = CommStats()
    d = onebit_all_reduce(u, topology=topo, method="hierarchical", stats=stats)
    lo, hi = d.clone(), d.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if not (torch.equal(lo, d) and torch.equal(hi, d)):
        raise PreflightError("collective", "the 1-bit all-reduce gave different results on different ranks")
    mean = d.double().mean().item()
    if abs(mean - 0.5) > 0.05 or d.abs().max().item() > 1:
        raise PreflightError("collective", f"the 1-bit all-reduce averaged {mean:.4f} where 0.5 was expected")
    seconds["onebit"] = _timed(lambda: onebit_all_reduce(u, topology=topo, method="hierarchical"), device, cfg.iters)

    names = sorted(seconds)  # the same on every rank; the slowest rank's time counts
    slowest = torch.tensor([seconds[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    seconds = dict(zip(names, slowest.tolist()))

    links = {}
    for name, (_, _, size) in groups.items():
        if name in seconds:  # ring all-reduce: each rank sends 2(m-1)/m of the buffer
            bus = 2 * (size - 1) / size * numel * 4 / seconds[name]
            links[name] = {"ranks": size, "seconds": seconds[name], "bus_bytes_per_s": bus}
    exp = expected_bytes("hierarchical", int(cfg.params), (k, lws))
    fp32_s = exp["fp32_allreduce_bytes"] / links["world"]["bus_bytes_per_s"]
    birder_s = sum(
        exp[f"{n}_node_bytes"] / links[n]["bus_bytes_per_s"] for n in ("intra", "inter") if exp[f"{n}_node_bytes"]
    )
    birder_bytes = exp["intra_node_bytes"] + exp["inter_node_bytes"]
    return {
        "links": links,
        "fp32_allreduce_mb": numel * 4 / 1e6,
        "onebit": {
            "method": "hierarchical",
            "numel": cfg.onebit_numel,
            "seconds": seconds["onebit"],
            "intra_node_bytes": stats.intra_node_bytes,
            "inter_node_bytes": stats.inter_node_bytes,
            "mean": mean,
        },
        "estimate": {
            "params": int(cfg.params),
            "fp32_allreduce_bytes": exp["fp32_allreduce_bytes"],
            "fp32_seconds": fp32_s,
            "birder_intra_node_bytes": exp["intra_node_bytes"],
            "birder_inter_node_bytes": exp["inter_node_bytes"],
            "birder_seconds": birder_s,
            "bytes_saving": exp["fp32_allreduce_bytes"] / birder_bytes,
            "time_saving": fp32_s / birder_s,
            "note": "bytes / measured bus bandwidth; ignores overlap with the backward pass, latency and codec time",
        },
    }


def run_rank(cfg: Config) -> int:
    import torch
    import torch.distributed as dist

    store, hosts = None, cfg.rank == 0 and not cfg.agent_store
    world = cfg.nnodes * cfg.nproc_per_node
    try:
        notes = check_interfaces(os.environ, [name for _, name in socket.if_nameindex()])
        if not cfg.from_node_process:
            node_checks(cfg, hosts_store=hosts)
        backend = cfg.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        claim = {
            "rank": cfg.rank,
            "nnodes": cfg.nnodes,
            "nproc_per_node": cfg.nproc_per_node,
            "node_rank": cfg.node_rank,
            "local_rank": cfg.local_rank,
            "host": socket.gethostname(),
            "backend": backend,
        }
        start = time.monotonic()
        with _stage(cfg, "rendezvous", 4 * cfg.timeout + 10):
            store = _open_store(cfg)
            _agree(store, cfg, claim)
        joined = time.monotonic() - start
        with _stage(cfg, "backend", 2 * cfg.timeout + 10):
            device = _init_backend(cfg, backend, store)
        initialised = time.monotonic() - start - joined
        report = {
            "ok": True,
            "nnodes": cfg.nnodes,
            "nproc_per_node": cfg.nproc_per_node,
            "world_size": world,
            "backend": backend,
            "master": f"{cfg.master_addr}:{cfg.master_port}",
            "interfaces": notes,
            "rendezvous_seconds": joined,
            "backend_seconds": initialised,
        }
        if world > 1:
            with _stage(cfg, "collective", cfg.timeout * (4 * cfg.iters + 8) + 30):
                report.update(_measure(cfg, device))
        if cfg.rank == 0:
            emit(cfg, report, render(report))
        code = 0
    except PreflightError as err:
        code = fail(cfg, err)
    if store is not None:
        with contextlib.suppress(Exception):
            store.add("exited", 1)
            if hosts:  # the store lives in this process: let every rank that joined finish with it first
                _wait_for(store, "exited", world if code == 0 else store.add("joined", 0), cfg.timeout)
    if dist.is_initialized():
        if code:  # peers may be stuck in a collective; tearing the group down could block: leave now
            sys.stdout.flush()
            os._exit(code)
        dist.destroy_process_group()
    return code


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def render(r: dict) -> str:
    k, lws = r["nnodes"], r["nproc_per_node"]
    lines = [
        f"birder-hf preflight: all checks passed - {k} node{'s' if k > 1 else ''} x {lws} rank"
        f"{'s' if lws > 1 else ''} per node = {r['world_size']} ranks, backend {r['backend']}, master {r['master']}",
        f"  ok  interfaces        {', '.join(r['interfaces']) or 'backend default (no *_SOCKET_IFNAME set)'}",
        f"  ok  master            {r['master']} resolves, is free on node 0 and reachable from every node",
        f"  ok  rendezvous        {r['world_size']} ranks joined in {_fmt_seconds(r['rendezvous_seconds'])}",
        f"  ok  layout            every rank agrees: {k} x {lws} (nodes x ranks per node)",
        f"  ok  backend           {r['backend']} initialised in {_fmt_seconds(r['backend_seconds'])}",
    ]
    if "links" not in r:
        return "\n".join([*lines, "  (one process: nothing to measure)"])
    ob, est = r["onebit"], r["estimate"]
    lines += [
        "  ok  fp32 all-reduce   correct on every group",
        f"  ok  1-bit all-reduce  hierarchical, {ob['numel']} elements: the same on every rank, mean {ob['mean']:.3f} "
        "(expected 0.5)",
        "",
        f"measured bandwidth: fp32 all-reduce of {r['fp32_allreduce_mb']:.1f} MB, median, slowest rank",
        "  link         ranks        time    bus bandwidth",
    ]
    names = {"intra": "intra-node", "inter": "inter-node", "world": "all ranks"}
    for name, link in r["links"].items():
        gbit = link["bus_bytes_per_s"] * 8 / 1e9
        lines.append(
            f"  {names[name]:<11} {link['ranks']:>6} {_fmt_seconds(link['seconds']):>11} {gbit:>11.2f} Gbit/s"
        )
    missing = [names[n] for n in ("intra", "inter") if n not in r["links"]]
    if missing:
        lines.append(f"  ({' and '.join(missing)}: one rank per group, nothing to measure)")
    lines += [
        f"  1-bit hierarchical all-reduce of {ob['numel']} elements: {_fmt_seconds(ob['seconds'])}",
        "",
        f"expected communication per step for {est['params'] / 1e6:.1f}M parameters",
        f"  (an estimate: {est['note']})",
        f"  fp32 all-reduce       {_fmt_bytes(est['fp32_allreduce_bytes']):>10} sent per rank  "
        f"{_fmt_seconds(est['fp32_seconds']):>10}",
        f"  Birder hierarchical   {_fmt_bytes(est['birder_intra_node_bytes'] + est['birder_inter_node_bytes']):>10} "
        f"sent per rank  {_fmt_seconds(est['birder_seconds']):>10}   (intra-node "
        f"{_fmt_bytes(est['birder_intra_node_bytes'])}, inter-node {_fmt_bytes(est['birder_inter_node_bytes'])})",
        f"  saving: {est['bytes_saving']:.1f}x fewer bytes, {est['time_saving']:.1f}x less communication time "
        "(estimate)",
    ]
    return "\n".join(lines)
