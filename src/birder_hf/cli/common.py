"""What the ``birder-hf preflight`` node process and its ranks share: exit codes, errors, output, node checks."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

EXIT_CODES = {
    "arguments": 2,
    "interface": 3,
    "resolve": 4,
    "port": 5,
    "reach": 6,
    "rendezvous": 7,
    "layout": 8,
    "backend": 9,
    "collective": 10,
}
_INTERNAL = 1
CHILD_ENV = "BIRDER_PREFLIGHT_AGENT"  # set by the node process for the ranks it starts: node checks are done


class PreflightError(Exception):
    """A failed check: ``check`` names it (a key of ``EXIT_CODES``), the message says how to fix it."""

    def __init__(self, check: str, message: str):
        super().__init__(message)
        self.check, self.code = check, EXIT_CODES[check]


@dataclass
class Config:
    nnodes: int
    node_rank: int
    nproc_per_node: int | None  # None: the node process decides (number of GPUs, or 1)
    master_addr: str
    master_port: int
    params: float
    size_mb: float
    onebit_numel: int
    iters: int
    timeout: float
    backend: str | None
    json: bool
    rank: int | None = None  # set when this process is one rank (RANK in the environment)
    local_rank: int | None = None
    agent_store: bool = False  # torchrun's agent already hosts the store at master_port
    from_node_process: bool = False

    @property
    def where(self) -> str:
        return f"node {self.node_rank}" + ("" if self.rank is None else f", rank {self.rank}")


# ------------------------------------------------------------------------------------------------ output
def emit(cfg: Config | None, payload: dict, text: str, *, error: bool = False) -> None:
    if cfg is not None and cfg.json:
        print(json.dumps(payload), flush=True)
    else:
        print(text, file=sys.stderr if error else sys.stdout, flush=True)


def fail(cfg: Config | None, err: PreflightError) -> int:
    where = cfg.where if cfg is not None else "this node"
    payload = {"ok": False, "check": err.check, "code": err.code, "message": str(err), "where": where}
    emit(cfg, payload, f"birder-hf preflight: FAILED {err.check} (exit {err.code}) on {where}: {err}", error=True)
    return err.code


def _warn(message: str) -> None:
    print(f"birder-hf preflight: warning: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- node checks
def check_interfaces(env, names: list[str]) -> list[str]:
    """Raise if GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name interfaces missing from ``names``; describe the rest."""
    seen = []
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = env.get(var, "").strip()
        if not value or value.startswith("^"):  # NCCL's "^x": exclusions cannot be missing
            continue
        wanted = [w for w in value.lstrip("=").split(",") if w]
        if var == "GLOO_SOCKET_IFNAME":  # gloo uses every listed interface, by exact name
            missing = [w for w in wanted if w not in names]
        else:  # NCCL uses interfaces starting with any listed prefix ("=" asks for exact names)
            exact = value.startswith("=")
            found = any(n == w if exact else n.startswith(w) for w in wanted for n in names)
            missing = [] if found else wanted
        if missing:
            what = f"{var}={value} names {', '.join(missing)}, but this host has {', '.join(sorted(names))}"
            fix = "name the interface on the network between the nodes (see `ip -br addr`), or unset it"
            raise PreflightError("interface", f"{what}; {fix}")
        seen.append(f"{var}={value}")
    return seen


def _resolve(host: str, port: int, timeout: float) -> list[tuple]:
    result: dict = {}

    def lookup():
        try:
            result["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            result["error"] = exc

    worker = threading.Thread(target=lookup, daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise PreflightError("resolve", f"the master address {host!r} did not resolve within {timeout:.0f} s (DNS?)")
    if "error" in result:
        what = f"the master address {host!r} does not resolve ({result['error']})"
        raise PreflightError("resolve", f"{what}; check --master_addr / MASTER_ADDR, /etc/hosts and DNS")
    return list(dict.fromkeys((family, addr) for family, _, _, _, addr in result["infos"]))


def _check_port_free(port: int) -> None:
    # TCPStore listens on every address with SO_REUSEADDR; bind the same way
    for family, any_addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((any_addr, port))
        except OSError as exc:
            if family == socket.AF_INET6 and exc.errno != 98:  # no IPv6 here: fine
                continue
            what = f"port {port} is already in use on node 0 ({exc.strerror}: another job, or an earlier run)"
            raise PreflightError("port", f"{what}; pick another --master_port / MASTER_PORT") from exc


def _is_local(addrs: list[tuple]) -> bool:
    for family, addr in addrs:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr[0], 0))
            return True
        except OSError:
            continue
    return False


def _process_age() -> float:
    """Seconds since this process started (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time after boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def _check_reachable(addrs: list[tuple], host: str, port: int, timeout: float) -> None:
    # --timeout counts from the start of the process: a slow start-up (importing torch on a busy node) must not
    # push the report past it; at least a couple of seconds of attempts remain
    deadline, last = time.monotonic() + max(2.0, timeout - _process_age()), None
    while True:
        for family, addr in addrs:
            try:
                with socket.socket(family, socket.SOCK_STREAM) as s:
                    s.settimeout(max(0.1, min(2.0, deadline - time.monotonic())))
                    s.connect(addr)
                return
            except OSError as exc:
                last = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    if isinstance(last, ConnectionRefusedError):
        why = "connection refused: the host answers, but nothing listens on that port"
    elif isinstance(last, (socket.timeout, TimeoutError)):
        why = "no answer: a wrong address, or a firewall dropping the packets"
    else:
        why = str(last)
    what = f"cannot connect to the master {host}:{port} within {timeout:.0f} s of starting ({why})"
    fix = "run preflight on node 0 with the same --master_addr/--master_port, and open that port between the nodes"
    raise PreflightError("reach", f"{what}; {fix}")


def node_checks(cfg: Config, *, hosts_store: bool) -> list[str]:
    notes = check_interfaces(os.environ, [name for _, name in socket.if_nameindex()])
    addrs = _resolve(cfg.master_addr, cfg.master_port, cfg.timeout)
    if cfg.agent_store:  # torchrun's agent holds the port and the rendezvous already succeeded
        return notes
    if hosts_store:
        _check_port_free(cfg.master_port)
        if not _is_local(addrs):
            _warn(
                f"the master address {cfg.master_addr} is not an address of this host, which runs node_rank 0: "
                "right behind NAT or a service address, otherwise run node_rank 0 on the host that owns it"
            )
    else:
        _check_reachable(addrs, cfg.master_addr, cfg.master_port, cfg.timeout)
    return notes
