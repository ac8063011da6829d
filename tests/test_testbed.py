"""Tests for `benchmarks/system/testbed.py` (network namespaces + tc shaping).

Opt-in (``python -m pytest -m netns``): they need root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and create network namespaces;
skipped without them.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "system"
_spec = importlib.util.spec_from_file_location("birder_benchmarks_testbed", _BENCH / "testbed.py")
testbed = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = testbed  # dataclasses look their module up here
_spec.loader.exec_module(testbed)

RATE_MBIT = 100

pytestmark = pytest.mark.netns


@pytest.fixture(autouse=True)
def _needs_namespaces():
    ok, reason = testbed.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {reason}")


def _alive(names):
    return [n for n in names if n in testbed._list_namespaces()]


def test_shaped_link_bandwidth_and_torchrun_across_namespaces():
    with testbed.Testbed("ethernet", rate_mbit=RATE_MBIT) as tb:
        names = list(tb.namespaces)
        assert len(_alive(names)) == 2
        bw = testbed.measure_bandwidth(tb, nbytes=5_000_000)
        for direction, mbit in bw.items():
            assert 0.7 * RATE_MBIT <= mbit <= 1.3 * RATE_MBIT, (direction, bw)
        rx0, tx0 = tb.link_bytes(0)
        runs = tb.launch_torchrun(_BENCH / "_testbed_smoke.py", nproc_per_node=1, args=["--numel", "1000"], timeout=90)
        for run in runs:
            assert run.ok, f"node {run.node} exited {run.returncode}:\n{run.log[-4000:]}"
            assert "world_size=2" in run.log and f"GROUP_RANK={run.node}" in run.log, run.log[-4000:]
        rx1, tx1 = tb.link_bytes(0)
        assert rx1 - rx0 > 4000 and tx1 - tx0 > 4000  # the all_reduce really crossed the veth
    assert _alive(names) == []


def test_ib_profile_is_much_faster_than_shaped():
    with testbed.Testbed("ib") as tb:
        assert tb.rate_mbit is None
        assert all("tbf" not in line for line in tb.describe()["qdiscs"])
        bw = testbed.measure_bandwidth(tb, nbytes=50_000_000)
        names = list(tb.namespaces)
    assert min(bw.values()) > 5 * RATE_MBIT, bw
    assert _alive(names) == []


def test_bridge_for_three_nodes():
    with testbed.Testbed("ethernet", rate_mbit=RATE_MBIT, nodes=3) as tb:
        names = [*tb.namespaces, tb.bridge_namespace]
        assert len(_alive(names)) == 4
        bw = testbed.measure_bandwidth(tb, nbytes=4_000_000, src=0, dst=2)
        for direction, mbit in bw.items():
            assert 0.7 * RATE_MBIT <= mbit <= 1.3 * RATE_MBIT, (direction, bw)
    assert _alive(names) == []


def test_namespaces_and_processes_removed_after_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with testbed.Testbed("ib") as tb:
            names = list(tb.namespaces)
            proc = tb.popen(0, ["sleep", "60"])
            assert proc.poll() is None
            raise RuntimeError("boom")
    assert proc.poll() is not None
    assert _alive(names) == []


def test_cleanup_stale_only_removes_dead_owners():
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"birdertest-{dead.pid}-0-n0", f"birdertest-{os.getpid()}-0-n0"
    try:
        for name in (stale, live):
            subprocess.run(["ip", "netns", "add", name], check=True)
        assert testbed.Testbed.cleanup_stale("birdertest") == [stale]
        assert _alive([stale, live]) == [live]
    finally:
        for name in _alive([stale, live]):
            subprocess.run(["ip", "netns", "del", name], check=True)


def test_delay_is_reported_not_fatal_without_netem():
    if testbed.latency_supported()[0]:
        pytest.skip("netem is available here; the fallback path is not exercised")
    with pytest.warns(UserWarning, match="not applied"):
        tb = testbed.Testbed("ethernet", delay_ms=5).start()
    try:
        info = tb.describe()
        assert info["delay_applied"] is False and info["notes"]
    finally:
        tb.close()


def test_argument_validation():
    with pytest.raises(ValueError, match="unshaped"):
        testbed.Testbed("ib", rate_mbit=100)
    with pytest.raises(ValueError, match="profile"):
        testbed.Testbed("wifi")
    with pytest.raises(ValueError, match="prefix"):
        testbed.Testbed(prefix="a-b")


def test_namespaces_removed_on_sigterm(tmp_path):
    script = tmp_path / "hold.py"
    script.write_text(
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('tb', {str(_BENCH / 'testbed.py')!r})\n"
        "tb_mod = importlib.util.module_from_spec(spec); sys.modules['tb'] = tb_mod; spec.loader.exec_module(tb_mod)\n"
        "with tb_mod.Testbed('ib', prefix='birdersig') as tb:\n"
        "    tb.popen(1, ['sleep', '60'])\n"
        "    print(' '.join(tb.namespaces), flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    names = proc.stdout.readline().split()
    assert len(_alive(names)) == 2
    proc.terminate()
    assert proc.wait(timeout=20) == 128 + 15
    assert _alive(names) == []
