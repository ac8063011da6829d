"""``birder-hf preflight``: check a multi-node launch in seconds, instead of hanging for the process-group timeout.

Our tool, not part of the paper. A job that cannot rendezvous waits for ``init_process_group``'s timeout (NCCL 10
minutes, gloo 30, by default in torch 2.14) and says little. Run this on every node, with the arguments (or
environment) of the real launch::

    birder-hf preflight --nnodes 4 --node_rank $NODE_RANK --nproc_per_node 8 --master_addr $MASTER_ADDR \\
        --master_port 29500 --params 25.6e6
    birder-hf preflight --config_file accelerate_configs/multi_node_4x8.yaml --machine_rank $NODE_RANK \\
        --main_process_ip $MASTER_ADDR                    # accelerate's flags and config file work too
    python -m birder_hf.preflight ...                     # the same

Run it directly on each node (``srun --ntasks-per-node=1`` under SLURM), not under ``torchrun``/``accelerate
launch``: their own rendezvous would hang before any check runs. Each node's process checks the node, then starts
``nproc_per_node`` ranks itself. (Started by a launcher that sets ``RANK``, each process runs as one rank.)

Values come from the flags, then the accelerate config file, then the environment: ``NNODES``/``GROUP_WORLD_SIZE``/
``SLURM_NNODES``, ``NODE_RANK``/``GROUP_RANK``/``SLURM_NODEID``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` (default 29500); ranks per node default to the number of GPUs (1 without CUDA).

Checks, in order; the first failure prints what is wrong and how to fix it, and exits with its code:

====  ============  ==========================================================================================
code  check         fails when
====  ============  ==========================================================================================
2     arguments     a value is missing or inconsistent (``--node_rank`` >= ``--nnodes``, ``WORLD_SIZE`` is not
                    nodes x ranks per node, ranks not node-major)
3     interface     ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` names an interface this host does not have
4     resolve       the master address does not resolve
5     port          the master port is already in use on node 0
6     reach         from another node, nothing answers on master address:port within ``--timeout``
7     rendezvous    not every rank joined within twice ``--timeout``
8     layout        ranks disagree on nodes x ranks per node (the hierarchy Birder will use), or two hosts claim
                    one node rank
9     backend       ranks disagree on the backend, or ``init_process_group`` or the first collective fails or
                    stalls for ``--timeout``
10    collective    an fp32 or 1-bit all-reduce fails, stalls or returns a wrong result
1     (internal)    anything unexpected (a traceback follows)
====  ============  ==========================================================================================

Every wait is bounded by ``--timeout`` (default 15 s; start the nodes within that of each other); a watchdog ends
any stage that makes no progress. Then rank 0 measures the fp32 all-reduce bandwidth of the intra-node, inter-node and
world groups, checks a 1-bit hierarchical all-reduce, and estimates the per-step communication for ``--params``
parameters (``docs/TROUBLESHOOTING.md``). ``--json`` prints one JSON object per line instead.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
import traceback

from .common import _INTERNAL, CHILD_ENV, EXIT_CODES, Config, PreflightError, check_interfaces, fail, node_checks  # noqa: F401
from .ranks import run_rank

__all__ = ["main", "cli", "PreflightError", "EXIT_CODES"]


_MIN_ONEBIT_NUMEL = 1 << 14
_MIN_TIMEOUT_S = 1.0


# ------------------------------------------------------------------------------------------ configuration
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="birder-hf preflight",
        description="Check a multi-node launch (addresses, ports, interfaces, layout, backend) and measure the links.",
        epilog="Exit codes: " + ", ".join(f"{c} {name}" for name, c in EXIT_CODES.items()) + ", 1 internal error.",
    )
    p.add_argument("--nnodes", "--num_machines", type=int, help="nodes in the job")
    p.add_argument("--node_rank", "--machine_rank", type=int, help="this node's index, 0 .. nnodes-1")
    p.add_argument("--nproc_per_node", type=int, help="ranks per node (default: GPUs, or 1)")
    p.add_argument("--num_processes", type=int, help="accelerate's total number of processes (all nodes)")
    p.add_argument("--master_addr", "--main_process_ip", help="address of node 0, as every node reaches it")
    p.add_argument("--master_port", "--main_process_port", type=int, help="a free port on node 0")
    p.add_argument("--config_file", help="an accelerate config file (num_machines, num_processes, main_process_*)")
    p.add_argument("--params", type=float, default=110e6, help="model size for the estimate (default: BERT-Base)")
    p.add_argument("--size_mb", type=float, default=64.0, help="fp32 all-reduce size for the bandwidth (MB)")
    p.add_argument("--onebit_numel", type=int, default=1 << 15, help="elements of the 1-bit all-reduce check")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions (the median is reported)")
    p.add_argument("--timeout", type=float, default=15.0, help="seconds any wait may take (default 15)")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    p.add_argument("--json", action="store_true", help="print JSON objects, one per line, instead of text")
    return p


def _read_accelerate_config(path: str) -> dict:
    try:
        import yaml
    except ImportError as exc:
        raise PreflightError("arguments", "--config_file needs PyYAML: pip install pyyaml") from exc
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except OSError as exc:
        raise PreflightError("arguments", f"cannot read --config_file {path}: {exc}") from exc
    except yaml.YAMLError as exc:  # a traceback before
        why = " ".join(str(exc).split())
        raise PreflightError("arguments", f"--config_file {path} is not valid YAML ({why})") from exc
    if not isinstance(data, dict):
        raise PreflightError("arguments", f"--config_file {path} is not an accelerate config (a YAML mapping)")
    for key in ("num_machines", "num_processes", "machine_rank", "main_process_port"):
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise PreflightError("arguments", f"{key}: {value!r} in --config_file {path} is not an integer")
    return data


def _first(*values):
    return next((v for v in values if v is not None and v != ""), None)


def _env_int(env, name: str) -> int | None:
    value = env.get(name, "")
    if value == "":
        return None
    try:
        return int(value.split("(")[0])  # SLURM writes "8(x4)" in some variables
    except ValueError as exc:
        raise PreflightError("arguments", f"{name}={value!r} in the environment is not an integer") from exc


def _config(args: argparse.Namespace, env) -> Config:
    acc = _read_accelerate_config(args.config_file) if args.config_file else {}
    nnodes = _first(args.nnodes, acc.get("num_machines"), *(_env_int(env, n) for n in ("NNODES", "GROUP_WORLD_SIZE")))
    nnodes = _first(nnodes, _env_int(env, "SLURM_NNODES"))
    total = _first(args.num_processes, acc.get("num_processes"))
    world_env, lws_env = _env_int(env, "WORLD_SIZE"), _env_int(env, "LOCAL_WORLD_SIZE")
    if nnodes is None and world_env and lws_env:
        nnodes = world_env // lws_env
    nnodes = int(_first(nnodes, 1))
    if nnodes < 1:  # before it divides anything
        raise PreflightError("arguments", f"--nnodes {nnodes} must be at least 1")
    if total is not None and int(total) < 1:
        raise PreflightError("arguments", f"--num_processes {total} must be at least 1")
    if total is not None and (int(total) < nnodes or int(total) % nnodes):
        raise PreflightError("arguments", f"num_processes={total} is not a multiple of {nnodes} nodes")
    nproc = _first(args.nproc_per_node, None if total is None else int(total) // nnodes, lws_env)
    node_rank = _first(args.node_rank, acc.get("machine_rank") if nnodes > 1 else None)
    node_rank = _first(node_rank, *(_env_int(env, n) for n in ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID")))
    master_addr = _first(args.master_addr, acc.get("main_process_ip"), env.get("MASTER_ADDR"))
    master_port = int(_first(args.master_port, acc.get("main_process_port"), _env_int(env, "MASTER_PORT"), 29500))
    if node_rank is None:
        if nnodes > 1:
            raise PreflightError("arguments", f"--node_rank is required with {nnodes} nodes (0 on the master node)")
        node_rank = 0
    if not 0 <= int(node_rank) < nnodes:
        raise PreflightError("arguments", f"--node_rank {node_rank} must lie in 0..{nnodes - 1} (--nnodes {nnodes})")
    if master_addr is None:
        if nnodes > 1:
            raise PreflightError(
                "arguments", "--master_addr (or MASTER_ADDR) is required with several nodes: the address of node 0"
            )
        master_addr = "127.0.0.1"
    if not 0 < master_port < 65536:
        raise PreflightError("arguments", f"--master_port {master_port} is not a TCP port (1..65535)")
    if nproc is not None and int(nproc) < 1:
        raise PreflightError("arguments", f"--nproc_per_node {nproc} must be at least 1")
    positive = {"size_mb": args.size_mb, "timeout": args.timeout, "iters": args.iters, "params": args.params}
    for name, value in {**positive, "onebit_numel": args.onebit_numel}.items():
        if not (math.isfinite(value) and value > 0):  # nan and inf too: a wait of nan seconds bounds nothing
            raise PreflightError("arguments", f"--{name} {value} must be a finite number > 0")
    # the 1-bit check compares the votes' mean with 0.5 within 0.05: 6 standard errors (a vote's variance is at most 1)
    # need 1 / sqrt(n) <= 0.05 / 6; fewer elements reported a failed collective on a healthy machine
    if args.onebit_numel < _MIN_ONEBIT_NUMEL:
        raise PreflightError("arguments", f"--onebit_numel {args.onebit_numel} must be at least {_MIN_ONEBIT_NUMEL}")
    if args.timeout < _MIN_TIMEOUT_S:  # the first wait (the rendezvous) timed out and was blamed on DNS
        raise PreflightError("arguments", f"--timeout {args.timeout:g} must be at least {_MIN_TIMEOUT_S:g} seconds")
    cfg = Config(
        nnodes=nnodes,
        node_rank=int(node_rank),
        nproc_per_node=None if nproc is None else int(nproc),
        master_addr=str(master_addr),
        master_port=master_port,
        params=args.params,
        size_mb=args.size_mb,
        onebit_numel=args.onebit_numel,
        iters=args.iters,
        timeout=args.timeout,
        backend=args.backend,
        json=args.json,
    )
    if _env_int(env, "RANK") is not None:  # started per rank (by our node process, torchrun, ...)
        cfg.rank = _env_int(env, "RANK")
        cfg.nproc_per_node = cfg.nproc_per_node or (world_env // nnodes if world_env else 1)
        world = nnodes * cfg.nproc_per_node
        cfg.local_rank = _first(_env_int(env, "LOCAL_RANK"), cfg.rank % cfg.nproc_per_node)
        if world_env is not None and world_env != world:
            raise PreflightError(
                "arguments",
                f"WORLD_SIZE={world_env} but {nnodes} nodes x {cfg.nproc_per_node} rank(s) per node = {world}",
            )
        if cfg.rank != cfg.node_rank * cfg.nproc_per_node + cfg.local_rank or cfg.local_rank >= cfg.nproc_per_node:
            raise PreflightError(
                "arguments",
                f"RANK={cfg.rank} is not node {cfg.node_rank} x {cfg.nproc_per_node} ranks per node + LOCAL_RANK="
                f"{cfg.local_rank}: Birder's hierarchy needs node-major ranks (torchrun's and accelerate's default)",
            )
        cfg.agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        cfg.from_node_process = env.get(CHILD_ENV) == "1"
    return cfg


# ------------------------------------------------------------------------------------------- node process
def _run_node(cfg: Config, argv: list[str]) -> int:
    try:
        node_checks(cfg, hosts_store=cfg.node_rank == 0)
    except PreflightError as err:
        return fail(cfg, err)
    if cfg.nproc_per_node is None:
        import torch

        cfg.nproc_per_node = max(1, torch.cuda.device_count())
    nproc, world = cfg.nproc_per_node, cfg.nnodes * cfg.nproc_per_node
    base = {
        **os.environ,
        "MASTER_ADDR": cfg.master_addr,
        "MASTER_PORT": str(cfg.master_port),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(cfg.node_rank),
        CHILD_ENV: "1",
    }
    base.setdefault("OMP_NUM_THREADS", "1")
    procs = []
    for local in range(nproc):
        env = {**base, "RANK": str(cfg.node_rank * nproc + local), "LOCAL_RANK": str(local)}
        procs.append(subprocess.Popen([sys.executable, "-m", "birder_hf.preflight", *argv], env=env))
    deadline = time.monotonic() + _budget(cfg)
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    stuck = [p for p in procs if p.poll() is None]
    for p in stuck:
        p.kill()
        p.wait()
    if stuck:
        return fail(cfg, PreflightError("backend", f"{len(stuck)} rank(s) of this node did not finish in time"))
    codes = [p.returncode for p in procs if p.returncode]
    return min((c for c in codes if c > 1), default=max(codes, default=0))


def _budget(cfg: Config) -> float:
    # every stage is bounded by --timeout; the measurements by one timeout per collective
    return cfg.timeout * (6 + 4 * (cfg.iters + 1)) + 60


# ------------------------------------------------------------------------------------------------ entry
def main(argv: list[str] | None = None) -> int:
    """Run the preflight with ``argv`` (default: ``sys.argv[1:]``); return the exit code (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    cfg = None
    try:
        cfg = _config(args, os.environ)
        if cfg.rank is None:
            return _run_node(cfg, argv)
        return run_rank(cfg)
    except PreflightError as err:
        return fail(cfg, err)
    except Exception:
        traceback.print_exc()
        return _INTERNAL


def cli(argv: list[str] | None = None) -> None:
    """The ``birder-hf`` console script: ``birder-hf preflight [options]``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: birder-hf preflight [options]   (birder-hf preflight --help for the options)")
        sys.exit(0 if argv else 2)
    if argv[0] != "preflight":
        print(f"birder-hf: unknown command {argv[0]!r}; available: preflight", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(argv[1:]))
