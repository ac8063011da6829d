"""Emulated multi-node testbed on one Linux host: network namespaces, veth links and `tc` shaping.

Each "node" is a network namespace (``<prefix>-<pid>-<seq>-n<i>``) with its own loopback and one veth
interface. Two nodes are joined by one veth pair (10.213.0.1/30 <-> 10.213.0.2/30); three or more nodes are
joined through a Linux bridge that lives in a dedicated namespace (``...-br``, nodes on 10.213.1.0/24), i.e. a
non-blocking switch. Nothing is created in, or routed to, the host's own network namespace, and every
namespace is deleted on exit, on exceptions and on SIGINT/SIGTERM/SIGHUP (``Testbed.cleanup_stale`` removes
the ones a SIGKILL-ed run left behind).

Profiles:

- ``"ethernet"``: every node's egress (and, with a bridge, the switch port's egress towards the node) is shaped
  with ``tc qdisc ... tbf rate <R>mbit``, so each node sends and receives at most R Mbit/s.
  Default R = 150 Mbit/s, chosen to reproduce the compute/communication balance of 10 GbE between A100
  nodes on this 2-core CPU: an A100 computes ~50-100x faster than these cores (FACTS.md), so
  10 Gbit/s / ~75 ~= 133 Mbit/s, rounded up to 150. Pass ``rate_mbit`` for other links
  (25 GbE -> ~330, 100 Gbit IB -> ~1300).
- ``"ib"``: unshaped veth (5-20 Gbit/s for one Python TCP stream here, CPU-bound; faster than scaled
  InfiniBand): the regime in which communication is nearly free and the codec's compute cost decides.

Measured TCP goodput is ~96.5% of the tbf rate (tbf counts Ethernet/IP/TCP headers): 48.1 at 50, 144.8 at 150,
963 at 1000 Mbit/s. ``measure_bandwidth`` records what a benchmark really got.

Latency: ``sch_netem`` is missing on this kernel, so delay cannot be emulated; the link adds only the
veth/queueing delay (tens of microseconds plus up to ``latency`` of tbf queueing). ``latency_supported()``
probes for netem; ``Testbed(delay_ms=...)`` applies netem when the probe succeeds and otherwise warns and
records ``delay_applied=False`` in ``describe()`` (the netem path is untested here). Add latency in the
application if a benchmark needs it.

Launching: gloo crosses namespaces only when ``GLOO_SOCKET_IFNAME`` names the node's veth (FACTS.md);
``Testbed.popen``/``run``/``launch_torchrun`` set it (and ``TP_SOCKET_IFNAME``). Ranks on the same node
still talk over the kernel's local path, not over the shaped link. ``launch_torchrun`` runs one torchrun
agent per node with the default static rendezvous (``--node_rank i --master_addr <node 0> --master_port P``);
c10d rendezvous also works (``rdzv="c10d"``) once node 0 is told to host the store
(``--rdzv_conf is_host=1``; torch guesses the host by resolving the hostname, which names the host's real address,
so without it no agent hosts the store and all time out). Each namespace has its own port space,
so fixed ports never collide with the host's.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` and ``tc`` (iproute2). ``available()`` says whether that
holds; tests skip with its reason in containers without those capabilities.

CLI::

    python benchmarks/system/testbed.py --profile ethernet --rate-mbit 150 check
    python benchmarks/system/testbed.py cleanup          # remove namespaces left by killed runs
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path

DEFAULT_ETHERNET_MBIT = 150  # 10 Gbit/s / ~75 (A100 vs 2 CPU cores), see module docstring
PROFILES = ("ethernet", "ib")
_SMOKE_SCRIPT = Path(__file__).with_name("_testbed_smoke.py")
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_LIVE: set[Testbed] = set()
_SAVED_HANDLERS: dict[int, object] = {}  # handlers replaced while any Testbed is live
_SEQ = iter(range(1 << 30))
_LOCK = threading.Lock()


def _sh(cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    # split on whitespace: every token is a literal or one of our validated names
    proc = subprocess.run(cmd.split(), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{cmd}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _ns_exists(name: str) -> bool:
    return name in _list_namespaces()


def _list_namespaces() -> list[str]:
    out = _sh("ip netns list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete_namespace(name: str) -> None:
    # processes still inside would keep the namespace (and its veth) alive after `ip netns del`
    for pid in _sh(f"ip netns pids {name}", check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _sh(f"ip netns del {name}", check=False)


@functools.cache
def _probe() -> tuple[bool, str, bool, str]:
    """Create a throwaway namespace with a shaped veth pair; report (ok, reason, netem_ok, netem_reason)."""
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, not {sys.platform}", False, "no namespaces"
    if os.geteuid() != 0:
        return False, "needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN) to create network namespaces", False, "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed", False, f"no {tool}"
    name = f"birderprobe-{os.getpid()}-0-probe"
    try:
        _sh(f"ip netns add {name}")
    except RuntimeError as exc:
        return False, f"cannot create a network namespace: {exc}", False, "no namespaces"
    try:
        try:
            _sh(f"ip -n {name} link add pa type veth peer name pb")
            _sh(f"tc -n {name} qdisc add dev pa root tbf rate 100mbit burst 64kb latency 50ms")
        except RuntimeError as exc:
            return False, f"cannot create a shaped veth pair: {exc}", False, "no veth/tbf"
        netem = _sh(f"tc -n {name} qdisc add dev pb root netem delay 1ms", check=False)
        netem_reason = "" if netem.returncode == 0 else f"sch_netem unavailable: {netem.stderr.strip()}"
        return True, "", netem.returncode == 0, netem_reason
    finally:
        _delete_namespace(name)


def available() -> tuple[bool, str]:
    """Whether namespaces, veth pairs and tbf shaping work here; ``(False, reason)`` otherwise."""
    ok, reason, _, _ = _probe()
    return ok, reason


def latency_supported() -> tuple[bool, str]:
    """Whether ``tc ... netem delay`` works here (it does not on the reference 2-core machine)."""
    ok, reason, netem_ok, netem_reason = _probe()
    return (netem_ok, netem_reason) if ok else (False, reason)


def _on_signal(signum, frame):
    # unwinds through Testbed.__exit__, which deletes the namespaces
    raise SystemExit(128 + signum)


def _close_all() -> None:
    for tb in list(_LIVE):
        tb.close()


atexit.register(_close_all)


@dataclasses.dataclass
class NodeRun:
    """Outcome of one node's command in ``Testbed.launch_torchrun``."""

    node: int
    returncode: int | None  # None: killed at the timeout
    log: str  # stdout and stderr together

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class Testbed:
    """Emulated nodes on one host (see the module docstring).

    Args:
        profile (`str`, *optional*, defaults to `"ethernet"`): `"ethernet"` (shaped) or `"ib"` (unshaped).
        rate_mbit (`float`, *optional*): per-direction node bandwidth for `"ethernet"`; defaults to 150.
        nodes (`int`, *optional*, defaults to 2): 2 uses one veth pair; more use a bridge namespace.
        prefix (`str`, *optional*, defaults to `"birder"`): namespace name prefix (letters, digits, `_`).
        delay_ms (`float`, *optional*): one-way delay via netem; warns and is skipped when netem is missing.

    Example::

        with Testbed("ethernet", rate_mbit=150) as tb:
            print(measure_bandwidth(tb))
            runs = tb.launch_torchrun("train.py", nproc_per_node=2, args=["--steps", "10"])
    """

    def __init__(
        self,
        profile: str = "ethernet",
        rate_mbit: float | None = None,
        nodes: int = 2,
        prefix: str = "birder",
        delay_ms: float | None = None,
    ):
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
        if profile == "ib" and rate_mbit is not None:
            raise ValueError("profile='ib' is unshaped; use profile='ethernet', rate_mbit=R to shape at any rate")
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        if not 2 <= nodes <= 250:
            raise ValueError(f"nodes must be in [2, 250], got {nodes}")
        if not re.fullmatch(r"[A-Za-z0-9_]+", prefix):
            raise ValueError(f"prefix may hold only letters, digits and '_' (it is parsed back), got {prefix!r}")
        self.profile = profile
        self.rate_mbit = (rate_mbit or DEFAULT_ETHERNET_MBIT) if profile == "ethernet" else None
        self.nodes = nodes
        self.prefix = prefix
        self.delay_ms = delay_ms
        self.delay_applied = False
        self.notes: list[str] = []
        with _LOCK:
            seq = next(_SEQ)
        base = f"{prefix}-{os.getpid()}-{seq}"
        self.namespaces = [f"{base}-n{i}" for i in range(nodes)]
        self.bridge_namespace = f"{base}-br" if nodes > 2 else None
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._port = 29500
        self.started = False

    # --- addressing -------------------------------------------------------------------------------------------
    def ifname(self, node: int) -> str:
        """The node's interface towards the other nodes (what GLOO_SOCKET_IFNAME names)."""
        return f"bv{node}"

    def addr(self, node: int) -> str:
        """The node's IPv4 address, reachable from every other node of this testbed."""
        self._check_node(node)
        return f"10.213.0.{node + 1}" if self.nodes == 2 else f"10.213.1.{node + 1}"

    def node_env(self, node: int) -> dict[str, str]:
        ifname = self.ifname(node)
        return {"GLOO_SOCKET_IFNAME": ifname, "TP_SOCKET_IFNAME": ifname, "BIRDER_TESTBED_NODE": str(node)}

    def _check_node(self, node: int) -> None:
        if not 0 <= node < self.nodes:
            raise IndexError(f"node must be in [0, {self.nodes}), got {node}")

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> Testbed:
        if self.started:
            raise RuntimeError("Testbed already started")
        ok, reason = available()
        if not ok:
            raise RuntimeError(f"cannot build a testbed here: {reason}")
        self.started = True
        with _LOCK:
            if not _LIVE and threading.current_thread() is threading.main_thread():
                for sig in _HANDLED_SIGNALS:
                    if signal.getsignal(sig) == signal.SIG_DFL:  # leave handlers the application set alone
                        _SAVED_HANDLERS[sig] = signal.signal(sig, _on_signal)
            _LIVE.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        if _ns_exists(name):
            raise RuntimeError(f"namespace {name} already exists (not ours to reuse)")
        _sh(f"ip netns add {name}")
        self._created.append(name)
        _sh(f"ip -n {name} link set lo up")

    def _build(self) -> None:
        for name in self.namespaces:
            self._add_namespace(name)
        shaped: list[tuple[str, str]] = []  # (namespace, device) whose egress is shaped
        if self.nodes == 2:
            a, b = self.namespaces
            # veth created directly inside the namespaces: it never appears in the host's namespace
            _sh(f"ip -n {a} link add {self.ifname(0)} type veth peer name {self.ifname(1)} netns {b}")
            for node in (0, 1):
                self._up(node, prefix_len=30)
                shaped.append((self.namespaces[node], self.ifname(node)))
        else:
            br = self.bridge_namespace
            self._add_namespace(br)
            _sh(f"ip -n {br} link add bbr type bridge")
            _sh(f"ip -n {br} link set bbr up")
            for node, ns in enumerate(self.namespaces):
                port = f"bp{node}"
                _sh(f"ip -n {br} link add {port} type veth peer name {self.ifname(node)} netns {ns}")
                _sh(f"ip -n {br} link set {port} master bbr")
                _sh(f"ip -n {br} link set {port} up")
                self._up(node, prefix_len=24)
                shaped += [(ns, self.ifname(node)), (br, port)]
        if self.delay_ms and not latency_supported()[0]:
            note = f"delay_ms={self.delay_ms} requested but not applied: {latency_supported()[1]}"
            warnings.warn(note, stacklevel=3)
            self.notes.append(note)
        for ns, dev in shaped:
            self._shape(ns, dev)

    def _up(self, node: int, prefix_len: int) -> None:
        ns, dev = self.namespaces[node], self.ifname(node)
        _sh(f"ip -n {ns} addr add {self.addr(node)}/{prefix_len} dev {dev}")
        _sh(f"ip -n {ns} link set {dev} up")

    def _shape(self, ns: str, dev: str) -> None:
        parent = "root"
        if self.delay_ms and latency_supported()[0]:
            # netem first, tbf as its child (the netem documentation's recipe); untested on this kernel
            _sh(f"tc -n {ns} qdisc add dev {dev} root handle 1: netem delay {self.delay_ms}ms")
            self.delay_applied = True
            parent = "parent 1:1 handle 10:"
        if self.rate_mbit is not None:
            # burst = 10 ms at line rate (>= 64 KiB): large enough for TCP to reach the rate, small next to transfers
            burst = max(64 * 1024, int(self.rate_mbit * 125_000 * 0.010))
            _sh(f"tc -n {ns} qdisc add dev {dev} {parent} tbf rate {self.rate_mbit}mbit burst {burst} latency 50ms")

    def close(self) -> None:
        """Kill everything started in the namespaces and delete them. Idempotent."""
        if not self.started:
            return
        main = threading.current_thread() is threading.main_thread()
        blocked = {signal.SIGINT, *_HANDLED_SIGNALS}
        if main:
            # a second Ctrl-C must not interrupt the teardown; it is delivered once the namespaces are gone
            signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
        try:
            for proc in self._procs:
                _kill_group(proc)
            self._procs.clear()
            for name in reversed(self._created):
                _delete_namespace(name)
            leftover = [n for n in self._created if _ns_exists(n)]
            self._created.clear()
            with _LOCK:
                _LIVE.discard(self)
                if not _LIVE and main:
                    for sig, handler in _SAVED_HANDLERS.items():
                        signal.signal(sig, handler)
                    _SAVED_HANDLERS.clear()
            self.started = False
            if leftover:
                raise RuntimeError(f"could not delete namespaces {leftover}")
        finally:
            if main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)

    # --- running commands ---------------------------------------------------------------------------------------
    def popen(self, node: int, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace; killed (with its process group) by ``close()``."""
        self._check_node(node)
        if not self.started:
            raise RuntimeError("start the Testbed (use it as a context manager) before running commands")
        full_env = {**os.environ, **self.node_env(node), **(env or {})}
        cmd = ["ip", "netns", "exec", self.namespaces[node], *map(str, argv)]
        proc = subprocess.Popen(cmd, env=full_env, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(
        self, node: int, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float | None = None, **kwargs
    ) -> subprocess.CompletedProcess:
        """Like ``subprocess.run`` (``capture_output=True, text=True`` by default), inside node ``node``."""
        kwargs.setdefault("text", True)
        if "stdout" not in kwargs and "stderr" not in kwargs:
            kwargs.setdefault("capture_output", True)
        capture = kwargs.pop("capture_output", False)
        if capture:
            kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
        proc = self.popen(node, argv, env=env, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def next_port(self) -> int:
        """A fresh port per launch (namespaces have their own port space; this only avoids TIME_WAIT reuse)."""
        self._port += 1
        return self._port

    def launch_torchrun(
        self,
        script: str | os.PathLike,
        nproc_per_node: int,
        args: Sequence[str] = (),
        master_port: int | None = None,
        timeout: float = 300.0,
        env: dict[str, str] | None = None,
        rdzv: str = "static",
    ) -> list[NodeRun]:
        """Run ``torchrun --nnodes K --nproc_per_node L ... script args`` once per node and wait for all.

        ``rdzv="static"`` (default) passes ``--node_rank i --master_addr <node 0> --master_port P``;
        ``rdzv="c10d"`` uses ``--rdzv_backend c10d --rdzv_endpoint <node 0>:P`` (node ranks then follow
        arrival order). On timeout every node is killed and its ``returncode`` is None.
        """
        if rdzv not in ("static", "c10d"):
            raise ValueError(f"rdzv must be 'static' or 'c10d', got {rdzv!r}")
        port = master_port or self.next_port()
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        common = [sys.executable, "-m", "torch.distributed.run"]
        common += f"--nnodes {self.nodes} --nproc_per_node {nproc_per_node}".split()
        if rdzv == "c10d":
            common += f"--rdzv_backend c10d --rdzv_endpoint {self.addr(0)}:{port} --rdzv_id {uuid.uuid4().hex}".split()
        logs, procs = [], []
        try:
            for node in range(self.nodes):
                if rdzv == "static":
                    where = f"--node_rank {node} --master_addr {self.addr(0)} --master_port {port}".split()
                else:
                    # c10d guesses the store host by matching the endpoint against the hostname, which resolves
                    # to the host's address, not the namespace's: say explicitly which agent hosts it
                    where = f"--local_addr {self.addr(node)} --rdzv_conf is_host={int(node == 0)}".split()
                log = tempfile.TemporaryFile(mode="w+")
                logs.append(log)
                argv = [*common, *where, str(script), *map(str, args)]
                procs.append(self.popen(node, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            codes: list[int | None] = []
            for proc in procs:
                try:
                    codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    codes.append(None)
            for proc in procs:
                _kill_group(proc)
                self._procs.remove(proc)
            out = []
            for node, (code, log) in enumerate(zip(codes, logs, strict=True)):
                log.seek(0)
                out.append(NodeRun(node, code, log.read()))
            return out
        finally:
            for log in logs:
                log.close()

    # --- inspection ---------------------------------------------------------------------------------------------
    def link_bytes(self, node: int) -> tuple[int, int]:
        """(rx, tx) bytes counted on the node's inter-node interface: what really crossed the emulated wire."""
        self._check_node(node)
        out = _sh(f"ip -n {self.namespaces[node]} -j -s link show dev {self.ifname(node)}").stdout
        stats = json.loads(out)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def describe(self) -> dict:
        """Plain-data description for benchmark records."""
        qdiscs = []
        if self.started:
            for ns in self._created:
                qdiscs += [f"{ns}: {line}" for line in _sh(f"tc -n {ns} qdisc show").stdout.splitlines()]
        return {
            "profile": self.profile,
            "rate_mbit": self.rate_mbit,
            "nodes": self.nodes,
            "topology": "veth pair" if self.nodes == 2 else "bridge",
            "namespaces": list(self.namespaces),
            "addresses": [self.addr(i) for i in range(self.nodes)],
            "ifnames": [self.ifname(i) for i in range(self.nodes)],
            "delay_ms": self.delay_ms,
            "delay_applied": self.delay_applied,
            "latency_emulation": latency_supported()[0],
            "notes": list(self.notes),
            "qdiscs": qdiscs,
        }

    @staticmethod
    def cleanup_stale(prefix: str = "birder") -> list[str]:
        """Delete namespaces named ``<prefix>-<pid>-...`` whose creating process is gone; returns their names."""
        pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-\d+-(n\d+|br|probe)$")
        removed = []
        for name in _list_namespaces():
            match = pattern.match(name)
            if match is None or _pid_alive(int(match.group(1))):
                continue
            _delete_namespace(name)
            removed.append(name)
        return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        try:
            os.killpg(proc.pid, sig)  # the group was made by start_new_session, so it holds only our children
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


_BW_RECEIVER = """
import json, socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1); print("ready", flush=True)
conn, _ = srv.accept(); buf = bytearray(1 << 20); n = 0; t0 = None
while True:
    k = conn.recv_into(buf)
    if not k:
        break
    if t0 is None:
        t0 = time.perf_counter()
    n += k
print(json.dumps({"bytes": n, "seconds": time.perf_counter() - t0}), flush=True)
"""

_BW_SENDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
chunk = bytes(1 << 20); left = int(sys.argv[3])
while left > 0:
    s.sendall(chunk[: min(left, len(chunk))]); left -= len(chunk)
s.shutdown(socket.SHUT_WR); s.recv(1)
"""


def _one_way_mbit(tb: Testbed, src: int, dst: int, nbytes: int, timeout: float) -> float:
    port = tb.next_port()
    recv = tb.popen(
        dst, [sys.executable, "-c", _BW_RECEIVER, tb.addr(dst), str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        if recv.stdout.readline().strip() != "ready":
            raise RuntimeError("bandwidth receiver did not start")
        send = tb.run(src, [sys.executable, "-c", _BW_SENDER, tb.addr(dst), str(port), str(nbytes)], timeout=timeout)
        if send.returncode != 0:
            raise RuntimeError(f"bandwidth sender failed: {send.stderr.strip()}")
        out, _ = recv.communicate(timeout=timeout)
        result = json.loads(out.strip().splitlines()[-1])
    finally:
        _kill_group(recv)
        if recv in tb._procs:
            tb._procs.remove(recv)
    return result["bytes"] * 8 / result["seconds"] / 1e6


def measure_bandwidth(
    tb: Testbed, nbytes: int = 20_000_000, src: int = 0, dst: int = 1, timeout: float = 120.0
) -> dict[str, float]:
    """Throughput of one TCP stream src->dst and dst->src in Mbit/s (timed at the receiver, first byte to EOF)."""
    return {
        f"{src}->{dst}": _one_way_mbit(tb, src, dst, nbytes, timeout),
        f"{dst}->{src}": _one_way_mbit(tb, dst, src, nbytes, timeout),
    }


def _check(args: argparse.Namespace) -> int:
    ok, reason = available()
    if not ok:
        print(f"testbed unavailable: {reason}")
        return 2
    print(f"latency emulation: {latency_supported()}")
    with Testbed(args.profile, rate_mbit=args.rate_mbit, nodes=args.nodes, prefix=args.prefix) as tb:
        info = tb.describe()
        print(json.dumps({k: v for k, v in info.items() if k != "qdiscs"}, indent=1))
        print("\n".join(info["qdiscs"]))
        bw = measure_bandwidth(tb, nbytes=args.bw_bytes)
        print("bandwidth (Mbit/s): " + ", ".join(f"{k}: {v:.1f}" for k, v in bw.items()))
        before = tb.link_bytes(0)
        t0 = time.perf_counter()
        runs = tb.launch_torchrun(
            _SMOKE_SCRIPT, args.nproc_per_node, ["--numel", str(args.numel)], rdzv=args.rdzv, timeout=args.timeout
        )
        elapsed = time.perf_counter() - t0
        after = tb.link_bytes(0)
        for run in runs:
            print(f"--- node {run.node}: returncode={run.returncode}")
            print("\n".join(line for line in run.log.splitlines() if "smoke" in line) or run.log[-3000:])
        print(
            f"torchrun smoke ({args.rdzv} rendezvous): {elapsed:.1f} s; node 0 link rx/tx during it: "
            f"{(after[0] - before[0]) / 1e6:.2f} / {(after[1] - before[1]) / 1e6:.2f} MB"
        )
        result = {"testbed": info, "bandwidth_mbit": bw, "smoke_ok": all(r.ok for r in runs), "smoke_s": elapsed}
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    print("namespaces removed:", not any(_ns_exists(n) for n in info["namespaces"]))
    return 0 if result["smoke_ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=PROFILES, default="ethernet")
    parser.add_argument(
        "--rate-mbit", type=float, default=None, help=f"ethernet only; default {DEFAULT_ETHERNET_MBIT}"
    )
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--rdzv", choices=("static", "c10d"), default="static")
    parser.add_argument("--bw-bytes", type=int, default=20_000_000, help="bytes per direction for the bandwidth check")
    parser.add_argument("--numel", type=int, default=1_000_000, help="fp32 elements in the timed smoke all_reduce")
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--json", default=None, help="write the check's results here")
    parser.add_argument("--prefix", default="birder", help="namespace prefix (check and cleanup)")
    parser.add_argument("command", choices=("check", "available", "cleanup"))
    args = parser.parse_args(argv)
    if args.command == "available":
        print(available(), "latency:", latency_supported())
        return 0 if available()[0] else 2
    if args.command == "cleanup":
        print("removed:", Testbed.cleanup_stale(args.prefix) + Testbed.cleanup_stale("birderprobe"))
        return 0
    return _check(args)


if __name__ == "__main__":
    sys.exit(main())
