"""The CPU-checkable parts of the GPU device check (``benchmarks/device_check.{py,sh}``) and the cost model's reading
of its ``gpu.json``: argument parsing, every measurement on tiny CPU sizes, the JSON schema the docs and
``cost_model.py`` rely on, and the shell script's glue."""

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"birder_benchmarks_{name}", _ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


device_check = _load("device_check")
cost_model = _load("cost_model")

JUNIT = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites>'
    '<testsuite name="pytest" errors="0" failures="1" skipped="1" tests="4">'
    '<testcase classname="tests.test_gpu_codec" name="test_a[13-eager]"/>'
    '<testcase classname="tests.test_gpu_codec" name="test_b">'
    '<failure message="AssertionError: 3 elements differ&#10;more">trace</failure></testcase>'
    '<testcase classname="tests.test_gpu_ddp" name="test_c"><skipped message="needs 2+ CUDA devices, found 1"/>'
    '</testcase><testcase classname="tests.test_gpu_ddp" name="test_d"/></testsuite></testsuites>'
)


def test_arguments():
    args = device_check.parse_args(["--device", "cpu"])
    assert args.codec_numel == [25_000_000, 110_000_000] and args.repeats == 30 and args.steps == 24
    assert args.only == ["codec", "hook", "memory"] and args.models == ["bert", "resnet50"]
    assert args.bert_precision == "tf32" and args.out == "docs/results/gpu.json"
    tiny = device_check.parse_args(["--device", "cpu", "--tiny", "--only", "hook", "--warmup", "0"])
    assert tiny.codec_numel == [40_001] and tiny.steps == 2 and tiny.warmup == 0 and tiny.only == ["hook"]
    with pytest.raises(SystemExit):
        device_check.parse_args(["--only", "nothing"])


def test_junit_summary(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    s = device_check.junit_summary(str(path))
    assert (s["tests"], s["passed"], s["failures"], s["skipped"]) == (4, 2, 1, 1)
    assert s["failed"] == ["tests.test_gpu_codec::test_b: AssertionError: 3 elements differ"]
    assert s["skipped_reasons"] == {"needs 2+ CUDA devices, found 1": 1}
    assert device_check.junit_summary(str(tmp_path / "missing.xml")) is None


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    """Every section on tiny CPU sizes (BERT with 2 layers of 32, timm's test_resnet), through main()."""
    d = tmp_path_factory.mktemp("device_check")
    (d / "junit.xml").write_text(JUNIT)
    out = d / "gpu.json"
    argv = ["--device", "cpu", "--tiny", "--repeats", "2", "--steps", "2", "--warmup", "1"]
    assert device_check.main([*argv, "--out", str(out), "--junit", str(d / "junit.xml")]) == 0
    return json.loads(out.read_text())


def test_tiny_cpu_run_writes_the_documented_schema(tiny_result):
    r = tiny_result
    assert r["schema"] == device_check.SCHEMA and r["tiny"] is True and r["errors"] == {}
    assert r["device"]["type"] == "cpu" and r["device"]["torch"] and r["tests"]["failures"] == 1
    assert {"codec", "hook", "memory", "targets", "command", "created"} <= set(r)
    assert [(c["numel"], c["compiled"]) for c in r["codec"]] == [(40_001, True), (40_001, False)]
    for c in r["codec"]:
        assert set(c["device_ms"]) == set(c["host_ms"]) == set(c["ratio_vs_copy"]) == set(device_check.CODEC_KERNELS)
        assert c["ratio_vs_copy"]["copy_ fp32"] == 1.0 and c["copy_GBps"] > 0
        assert isinstance(c["target_quantize_pack_met"], bool)
    assert [h["model"] for h in r["hook"]] == ["bert (tiny)", "resnet50 (tiny)"]
    for h in r["hook"]:
        assert h["world_size"] == 1 and h["backend"] == "gloo" and h["timed_steps"] == 2
        assert h["adamw_step_ms"] > 0 and h["birder_step_ms"] > 0 and h["numel"] > 0
        assert h["copy_s_per_elem"] > 0 and isinstance(h["codec_copies"], float)
        assert h["overhead_pct"] == pytest.approx(100 * (h["birder_step_ms"] / h["adamw_step_ms"] - 1), abs=0.1)
    assert r["hook"][1]["memory_format"] == "channels_last"
    for m in r["memory"]:
        assert m["adamw"]["optimizer_state_MiB"] >= 0 and "peak_MiB" not in m["adamw"]  # no CUDA allocator here
        assert m["expected_birder_minus_adamw_MiB"] == round(8 * m["numel"] / 2**20, 1)
    table = device_check.table(r)
    assert "quantize+pack" in table and "resnet50 (tiny)" in table


def _as_gpu_measurement(result, **changes):
    g = copy.deepcopy(result)
    g["tiny"] = False
    g["device"].update(type="cuda", name="NVIDIA Test GPU")
    for h, model in zip(g["hook"], ("bert", "resnet50")):
        h["model"] = model
    g.update(changes)
    return g


def test_cost_model_reads_gpu_json(tiny_result, tmp_path):
    # a tiny or CPU run is no GPU measurement: the model stays on its CPU / default calibration
    (tmp_path / "gpu.json").write_text(json.dumps(tiny_result))
    assert cost_model.calibrate(tmp_path)["source"] == "fused default"
    g = _as_gpu_measurement(tiny_result)
    g["hook"][0]["codec_copies"], g["hook"][1]["codec_copies"] = 1.25, -0.5
    (tmp_path / "gpu.json").write_text(json.dumps(g))
    calib = cost_model.calibrate(tmp_path)
    assert calib["source"] == "gpu" and "NVIDIA Test GPU" in calib["measured_from"]
    assert calib["measured_copies"] == {"bert": 1.25, "resnet50": 0.0}  # a cheaper step is not a faster codec
    rows = cost_model.predict("tf32", calib, "measured")
    one = next(p for p in rows if p["model"] == "bert" and p["nodes"] == 1 and p["method"] == "birder-hierarchical")
    assert one["codec_s"] == pytest.approx(
        cost_model.codec_time("birder-allgather", cost_model.NUMEL["bert"], 1.25, cost_model.ASSUMPTIONS)
    )
    # without hook records, the compiled kernels' ratios stand in
    g = _as_gpu_measurement(tiny_result, hook=[])
    (tmp_path / "gpu.json").write_text(json.dumps(g))
    r = g["codec"][0]["ratio_vs_copy"]
    assert cost_model.calibrate(tmp_path)["measured_copies"]["bert"] == pytest.approx(
        3 + r["quantize+pack"] + r["unpack"] + 1.5
    )


def test_device_check_sh_glue(tmp_path):
    # the shell driver on a CPU: environment report, no test suite, the codec section, results in $OUT
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "BIRDER_DEVICE_TESTS": "0"}
    args = ["--device", "cpu", "--tiny", "--only", "codec", "--repeats", "2"]
    proc = subprocess.run(
        ["bash", str(_ROOT / "benchmarks" / "device_check.sh"), *args],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "birder_hf" in proc.stdout and "no CUDA device" in proc.stdout
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["tests"] is None and [c["numel"] for c in result["codec"]] == [40_001, 40_001]
    assert (tmp_path / "device_check.log").exists()
