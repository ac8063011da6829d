"""``birder-hf preflight`` on real processes over loopback (and across network namespaces where root allows it).

One module fixture starts every multi-process case: first the fast failures (they exit right after start-up), then,
while the wrong-port worker waits out its default timeout, the layout disagreement and the 4-rank success case
(2 simulated nodes x 2 ranks). About 25 s of wall time on an idle 2-core machine, mostly that default timeout.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from birder_hf.cli import preflight
from birder_hf.cli.ranks import _judge, _ranges, render

ROOT = Path(__file__).resolve().parents[1]
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "NNODES",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "SLURM_NNODES",
    "SLURM_NODEID",
    "TORCHELASTIC_USE_AGENT_STORE",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Run:
    def __init__(self, args, env=None, popen=subprocess.Popen):
        full = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
        full.update({"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **(env or {})})
        self.start = time.monotonic()
        self.proc = popen(
            [sys.executable, "-m", "birder_hf.preflight", *map(str, args)],
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._waiter = threading.Thread(target=self._wait, daemon=True)  # notes when the process really ended
        self._waiter.start()

    def _wait(self):
        self.out, self.err = self.proc.communicate()
        self.elapsed = time.monotonic() - self.start

    def result(self, timeout=150):
        self._waiter.join(timeout)
        if self._waiter.is_alive():
            self.proc.kill()
            self._waiter.join()
            raise AssertionError(f"preflight did not finish within {timeout} s:\n{self.out}\n{self.err}")
        self.code = self.proc.returncode
        return self


def _rank_env(rank, world, local_rank, local_world, node, port):
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@pytest.fixture(scope="module")
def runs():
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    worker = ["--nnodes", 2, "--node_rank", 1, "--nproc_per_node", 1]
    started = {
        # default --timeout: the report must come within 30 s
        "wrong_port": _Run([*worker, "--master_addr", "127.0.0.1", "--master_port", _free_port()]),
        "bad_host": _Run([*worker, "--master_addr", "no-such-host.invalid", "--master_port", 29500]),
        "bad_iface": _Run([*worker, "--master_addr", "127.0.0.1"], env={"GLOO_SOCKET_IFNAME": "birder_nosuch0"}),
        "port_busy": _Run(
            ["--nnodes", 2, "--node_rank", 0, "--master_addr", "127.0.0.1", "--master_port", busy.getsockname()[1]]
        ),
        "no_addr": _Run(worker),
    }
    done = {name: started.pop(name).result() for name in ("bad_host", "bad_iface", "port_busy", "no_addr")}
    busy.close()

    # the same rendezvous, two claims: rank 0 says 2 nodes x 1, rank 1 says 1 node x 2
    port = _free_port()
    layout = [
        _Run(["--nnodes", 2, "--timeout", 60, "--json"], env=_rank_env(0, 2, 0, 1, 0, port)),
        _Run(["--nnodes", 1, "--timeout", 60], env=_rank_env(1, 2, 1, 2, 0, port)),
    ]
    done["layout"] = [r.result() for r in layout]

    # success: 2 simulated nodes x 2 ranks, one node process per node (as on a cluster)
    port = _free_port()
    common = ["--nnodes", 2, "--nproc_per_node", 2, "--master_addr", "127.0.0.1", "--master_port", port]
    common += ["--timeout", 60, "--size_mb", 1, "--iters", 3, "--params", 110e6]
    nodes = [_Run([*common, "--node_rank", n]) for n in (0, 1)]
    done["success"] = [r.result() for r in nodes]
    done["wrong_port"] = started.pop("wrong_port").result()
    return done


def test_closed_port_is_reported_within_30_seconds(runs):
    r = runs["wrong_port"]
    assert r.code == preflight.EXIT_CODES["reach"] == 6, r.err
    assert r.elapsed < 30, r.elapsed
    assert "connection refused" in r.err and "127.0.0.1:" in r.err


def test_unresolvable_host(runs):
    r = runs["bad_host"]
    assert r.code == preflight.EXIT_CODES["resolve"], r.err
    assert "'no-such-host.invalid' does not resolve" in r.err


def test_missing_interface(runs):
    r = runs["bad_iface"]
    assert r.code == preflight.EXIT_CODES["interface"], r.err
    assert "GLOO_SOCKET_IFNAME=birder_nosuch0" in r.err and "lo" in r.err


def test_port_in_use_on_the_master(runs):
    r = runs["port_busy"]
    assert r.code == preflight.EXIT_CODES["port"], r.err
    assert "already in use" in r.err


def test_missing_master_address(runs):
    r = runs["no_addr"]
    assert r.code == preflight.EXIT_CODES["arguments"], r.err
    assert "--master_addr (or MASTER_ADDR) is required" in r.err


def test_ranks_disagreeing_on_the_layout_all_fail_with_the_message(runs):
    r0, r1 = runs["layout"]
    assert r0.code == r1.code == preflight.EXIT_CODES["layout"] == 8, (r0.out, r0.err, r1.err)
    error = json.loads(r0.out.strip().splitlines()[-1])  # --json: one object per line
    assert error["ok"] is False and error["check"] == "layout" and error["code"] == 8
    for message in (error["message"], r1.err):
        assert "rank 0: 2 nodes x 1 rank per node; rank 1: 1 node x 2 ranks per node" in message


def test_two_simulated_nodes_pass_and_report_bandwidth_and_saving(runs):
    node0, node1 = runs["success"]
    assert node0.code == 0 and node1.code == 0, node0.out + node0.err + node1.err
    table = node0.out
    assert "all checks passed - 2 nodes x 2 ranks per node = 4 ranks, backend gloo" in table
    assert "1-bit all-reduce  hierarchical" in table and "the same on every rank" in table
    for link in ("intra-node       2", "inter-node       2", "all ranks        4"):
        assert link in table and "Gbit/s" in table
    # 110M parameters on 2 x 2: bytes per expected_bytes(): 660.0 MB fp32 vs 27.5 MB for Birder, 24.0x
    assert "expected communication per step for 110.0M parameters\n  (an estimate: bytes / measured" in table
    assert "660.0 MB sent per rank" in table and "27.5 MB sent per rank" in table
    assert "saving: 24.0x fewer bytes" in table and "less communication time (estimate)" in table
    assert node1.out == ""  # only rank 0 reports


# ------------------------------------------------------------------------------------------------ in process
def test_cli_dispatch(capsys):
    with pytest.raises(SystemExit) as exc:
        preflight.cli(["train"])
    assert exc.value.code == 2 and "unknown command 'train'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        preflight.cli(["preflight", "--nnodes", "2", "--node_rank", "2", "--master_addr", "x"])
    assert exc.value.code == 2 and "--node_rank 2 must lie in 0..1" in capsys.readouterr().err


def test_config_reads_flags_then_accelerate_config_then_environment(tmp_path):
    def config(argv, env=None):
        return preflight._config(preflight._parser().parse_args(argv), env or {})

    yaml_file = tmp_path / "acc.yaml"
    yaml_file.write_text("num_machines: 4\nmachine_rank: 0\nnum_processes: 32\nmain_process_ip: 10.0.0.1\n")
    cfg = config(["--config_file", str(yaml_file), "--machine_rank", "3"], {"MASTER_PORT": "29611"})
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc_per_node) == (4, 3, 8)
    assert (cfg.master_addr, cfg.master_port) == ("10.0.0.1", 29611)
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "MASTER_ADDR": "head", "LOCAL_WORLD_SIZE": "4"}
    cfg = config([], env)
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc_per_node) == (2, 1, 4)
    assert (cfg.master_addr, cfg.master_port) == ("head", 29500)
    assert config([]).master_addr == "127.0.0.1"  # one node: loopback
    launched = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "MASTER_ADDR": "h"}
    with pytest.raises(preflight.PreflightError, match=r"WORLD_SIZE=4 but 2 nodes x 1 rank\(s\) per node = 2"):
        config(["--nnodes", "2"], launched)
    with pytest.raises(preflight.PreflightError, match="node-major"):
        config(["--nnodes", "2", "--node_rank", "1", "--master_addr", "h"], {"RANK": "0", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(preflight.PreflightError, match="--node_rank is required"):
        config(["--nnodes", "2", "--master_addr", "h"])
    # issue 41: a 1-bit check too small to be judged reported a failed collective; a wait too short to connect was
    # blamed on DNS
    with pytest.raises(preflight.PreflightError, match="--onebit_numel 1 must be at least 16384"):
        config(["--onebit_numel", "1"])
    with pytest.raises(preflight.PreflightError, match="--timeout 0.001 must be at least 1 seconds"):
        config(["--timeout", "0.001"])
    # issue 41: invalid YAML and a word for a number exited 1 with a traceback
    for text, says in (
        ("num_machines: [2\n", "is not valid YAML"),
        ("- a list\n", "is not an accelerate config"),
        ("num_machines: two\n", "num_machines: 'two' in --config_file .* is not an integer"),
    ):
        yaml_file.write_text(text)
        with pytest.raises(preflight.PreflightError, match=says):
            config(["--config_file", str(yaml_file)])


def test_interface_names_follow_gloo_and_nccl_rules():
    names = ["lo", "eth0", "ib0"]
    assert preflight.check_interfaces({"GLOO_SOCKET_IFNAME": "eth0,lo"}, names) == ["GLOO_SOCKET_IFNAME=eth0,lo"]
    preflight.check_interfaces({"NCCL_SOCKET_IFNAME": "eth"}, names)  # NCCL matches prefixes
    preflight.check_interfaces({"NCCL_SOCKET_IFNAME": "^docker"}, names)  # exclusions cannot be missing
    with pytest.raises(preflight.PreflightError, match="NCCL_SOCKET_IFNAME==eth names eth"):
        preflight.check_interfaces({"NCCL_SOCKET_IFNAME": "=eth"}, names)  # "=": exact names only
    with pytest.raises(preflight.PreflightError, match="names eth1") as exc:
        preflight.check_interfaces({"GLOO_SOCKET_IFNAME": "eth0,eth1"}, names)
    assert exc.value.code == 3


def test_judge_names_who_disagrees():
    claim = dict(nnodes=2, nproc_per_node=2, host="a", backend="gloo")
    table = [dict(claim, rank=r, node_rank=r // 2, host="ab"[r // 2]) for r in range(4)]
    assert _judge(table) is None
    check, message = _judge([*table[:3], dict(table[3], nproc_per_node=4, nnodes=1)])
    assert check == "layout" and "ranks 0-2: 2 nodes x 2 ranks per node; rank 3: 1 node x 4 ranks per node" in message
    check, message = _judge([*table, dict(table[1], host="c")])
    assert check == "layout" and "2 processes claim rank 1 (on a, c)" in message
    check, message = _judge([*table[:3], dict(table[3], host="c")])
    assert check == "layout" and "node_rank 1 is claimed by several hosts (b, c)" in message
    assert _judge([*table[:3], dict(table[3], backend="nccl")])[0] == "backend"
    assert _ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"


def test_render_without_inter_node_links():
    report = {
        "nnodes": 1,
        "nproc_per_node": 1,
        "world_size": 1,
        "backend": "gloo",
        "master": "127.0.0.1:1",
        "interfaces": [],
        "rendezvous_seconds": 0.1,
        "backend_seconds": 0.1,
    }
    assert "one process: nothing to measure" in render(report)


_BENCH = ROOT / "benchmarks"


def _testbed():
    spec = importlib.util.spec_from_file_location("birder_benchmarks_testbed", _BENCH / "system" / "testbed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.netns
def test_two_hosts_in_network_namespaces_measure_the_shaped_link():
    testbed = _testbed()
    ok, reason = testbed.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {reason}")
    rate = 150  # Mbit/s per direction
    with testbed.Testbed("ethernet", rate_mbit=rate) as tb:
        port = tb.next_port()
        args = ["--nnodes", 2, "--nproc_per_node", 1, "--master_addr", tb.addr(0), "--master_port", port]
        args += ["--timeout", 60, "--size_mb", 1, "--iters", 3, "--json"]
        runs = [_Run([*args, "--node_rank", n], popen=lambda cmd, n=n, **kw: tb.popen(n, cmd, **kw)) for n in (0, 1)]
        # a wrong address (TEST-NET-1: no route inside the namespace, nothing leaves it), default --timeout
        wrong = ["--nnodes", 2, "--node_rank", 1, "--nproc_per_node", 1, "--master_addr", "192.0.2.1"]
        lost = _Run(wrong, popen=lambda cmd, **kw: tb.popen(1, cmd, **kw))
        results = [r.result() for r in runs]
        lost.result()
    assert lost.code == preflight.EXIT_CODES["reach"] and lost.elapsed < 30, (lost.elapsed, lost.err)
    assert "cannot connect to the master 192.0.2.1:29500" in lost.err
    assert all(r.code == 0 for r in results), [r.err for r in results]
    report = json.loads(results[0].out.strip().splitlines()[-1])
    assert report["ok"] and report["interfaces"] == [f"GLOO_SOCKET_IFNAME={tb.ifname(0)}"]
    gbit = report["links"]["inter"]["bus_bytes_per_s"] * 8 / 1e9
    assert 0.5 * rate / 1e3 < gbit < 1.2 * rate / 1e3, gbit  # the veth's tbf rate, seen from the all-reduce
    assert "intra" not in report["links"] and report["estimate"]["time_saving"] > 1


def _doc_commands(text: str, prefix: str, markdown: bool) -> list[str]:
    # shell lines that run `prefix` (in ```bash blocks of a markdown file), with their continuation lines
    lines, out, in_bash = text.splitlines(), [], not markdown
    for i, line in enumerate(lines):
        if markdown and line.startswith("```"):
            in_bash = line.strip() == "```bash"
        if in_bash and prefix in line and not line.lstrip().startswith("#"):
            cmd = line[line.index(prefix) :]
            while cmd.rstrip().endswith("\\"):
                i += 1
                cmd = cmd.rstrip()[:-1] + " " + lines[i].strip()
            out.append(cmd)
    return out


@pytest.mark.parametrize(
    "doc", ["docs/TROUBLESHOOTING.md", "recipes/README.md", "accelerate_configs/slurm_multi_node.sh"]
)
def test_docs_show_preflight_next_to_every_multi_node_launch_and_its_lines_parse(doc, monkeypatch):
    text = (ROOT / doc).read_text(encoding="utf-8")
    md = doc.endswith(".md")
    launches = [c for c in _doc_commands(text, "accelerate launch", md) if "multi_node" in c or "--num_machines" in c]
    checks = _doc_commands(text, "birder-hf preflight", md)
    assert launches and len(checks) >= len(launches), (launches, checks)
    for launch in launches:  # each launch's layout source (config file or --num_machines) has its preflight
        source = next(w for w in launch.split() if "multi_node" in w or w == "--num_machines")
        assert any(source in c or (source == "--num_machines" and "--nnodes" in c) for c in checks), launch
    shell = {"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "IP_OF_NODE0": "10.0.0.1", "FREEPORT": "29500", "rank": "1"}
    shell.update({"SLURM_NODEID": "1", "MASTER_PORT": "29500"})
    monkeypatch.chdir(ROOT)
    for cmd in checks:
        for name, value in shell.items():
            cmd = cmd.replace(f'"${name}"', value).replace(f"${name}", value)
        argv = cmd.rstrip("'").split()[2:]
        argv = argv[: argv.index("&")] if "&" in argv else argv
        assert not any("$" in a for a in argv), argv
        cfg = preflight._config(preflight._parser().parse_args(argv), {})
        assert cfg.nnodes > 1 and cfg.node_rank in (0, 1) and cfg.master_addr, cmd


def test_a_size_that_does_not_fit_in_memory_is_an_arguments_error():
    # issue 41: --size_mb 1e6 (a terabyte per rank) failed to allocate, and the report blamed a failed collective
    run = _Run(["--nnodes", 1, "--nproc_per_node", 2, "--timeout", 60, "--size_mb", 1e6]).result()
    assert run.code == 2, (run.out, run.err)
    assert "--size_mb 1e+06 does not fit in memory here" in run.out + run.err
