"""Smoke tests of the communication benchmarks (``benchmarks/system/throughput.py``, its worker, ``cost_model.py``).

Tiny models only: a 26k-parameter MLP on two forked local ranks (no namespaces needed), the testbed path (torchrun in
two network namespaces) when namespaces can be created (skipped otherwise), and the cost model's arithmetic.
"""

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
from _dist import run_distributed

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    path = _BENCH / f"{name}.py"
    if not path.exists():
        path = _BENCH / "system" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"birder_benchmarks_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


throughput = _load("throughput")
cost_model = _load("cost_model")
worker = _load("_throughput_worker")

METHOD_KEYS = {
    "method",
    "optimizer",
    "timed_steps",
    "step_s",
    "step_s_mean",
    "samples_per_s",
    "fwd_bwd_s",
    "opt_s",
    "link_per_node",
    "inter_node_tx_bytes_per_step",
    "commstats_per_step",
    "analytic_bytes_per_rank",
    "model",
    "batch_per_proc",
    "world_size",
    "numel",
}


def _run_worker(rank, world_size, argv):
    return worker.main(argv)


@pytest.fixture(scope="module")
def local_records(tmp_path_factory):
    """Two forked ranks on loopback: every method, interleaved with two no-communication references."""
    out = tmp_path_factory.mktemp("throughput") / "records.jsonl"
    methods = ["fp32-sgdm", "fp16", "powersgd", "birder-allgather", "birder-scatter_gather", "birder-hierarchical"]
    methods += ["onebitadam"]
    refs = ["ref-compute", "ref-birder", "ref-onebitadam"]
    argv = ["--model", "tiny-mlp", "--batch", "4", "--methods", *methods, "--refs", *refs]
    argv += ["--rounds", "1", "--tag", json.dumps({"profile": "local"}), "--out", str(out)]
    assert run_distributed(_run_worker, 2, argv, local_world_size=2, timeout=300) == [0, 0]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_worker_emits_expected_records(local_records):
    meta = [r for r in local_records if r["kind"] == "meta"]
    assert len(meta) == 1 and meta[0]["world_size"] == 2 and meta[0]["numel"] > 0 and meta[0]["copy_s_per_elem"] > 0
    assert meta[0]["order"][:3] == ["ref-compute", "ref-birder", "ref-onebitadam"]
    recs = {r["method"]: r for r in local_records if r["kind"] == "method"}
    assert set(recs) == {
        "ref-compute",
        "ref-birder",
        "ref-onebitadam",
        "fp32-sgdm",
        "fp16",
        "powersgd",
        "onebitadam",
    } | {f"birder-{m}" for m in ("allgather", "scatter_gather", "hierarchical")}
    for name, rec in recs.items():
        assert METHOD_KEYS <= set(rec), (name, METHOD_KEYS - set(rec))
        assert rec["timed_steps"] == 1 and rec["samples_per_s"] > 0 and rec["step_s_mean"] > 0
        assert rec["link_per_node"] is None  # loopback: no inter-node interface to count
    assert recs["fp32-sgdm"]["analytic_bytes_per_rank"] == 4 * recs["fp32-sgdm"]["numel"]  # 2(n-1)/n x 4d, n = 2
    assert recs["fp16"]["analytic_bytes_per_rank"] == 2 * recs["fp16"]["numel"]
    for m in ("birder-allgather", "birder-scatter_gather", "birder-hierarchical", "onebitadam"):
        stats = recs[m]["commstats_per_step"]
        assert stats["calls"] >= 1 and stats["compression_ratio"] > 16  # 1 bit per value, padding aside
    assert recs["powersgd"]["powersgd"]["rank"] == 4
    for tl in recs["birder-hierarchical"]["timeline_last_step"]:  # per rank: every bucket's hook call and its Future
        assert tl["buckets"] and tl["backward_end"] <= tl["step_end"]
        assert all(0 <= e["call"] <= e["ret"] <= e["done"] and e["call"] <= tl["backward_end"] for e in tl["buckets"])


def test_summary_targets_table_and_plots(local_records, tmp_path):
    summary = throughput.summarize([r for r in local_records if r["kind"] != "progress"])
    rows = {r["method"]: r for r in summary}
    assert rows["fp32-sgdm"]["ratio_vs_fp32"] == pytest.approx(1.0)
    for method in ("birder-hierarchical", "onebitadam"):
        b = rows[method]["breakdown"]
        assert b["basis"] == "cpu" and min(b["compute_s"], b["codec_s"], b["comm_cpu_s"]) >= 0
        assert b["compute_s"] + b["codec_s"] + b["comm_cpu_s"] + b["wait_s"] == pytest.approx(rows[method]["step_s"])
        row, ref = rows[method], {r["method"]: r for r in local_records if r["kind"] == "method"}
        fp32, nocomm = ref["fp32-sgdm"]["step_s_mean"], ref["ref-compute"]["step_s_mean"]
        assert row["bound_vs_fp32"] == pytest.approx(fp32 / nocomm)
        assert row["share_of_bound"] == pytest.approx(row["ratio_vs_fp32"] / row["bound_vs_fp32"])
        # one round: the per-round (paired) estimates are the same ratios
        assert row["ratio_vs_fp32_paired_median"] == pytest.approx(fp32 / ref[method]["step_s_mean"])
        assert row["share_of_bound_paired_median"] == pytest.approx(nocomm / ref[method]["step_s_mean"])
    assert rows["birder-hierarchical"]["codec_bound_vs_fp32"] == pytest.approx(
        ref["fp32-sgdm"]["step_s_mean"] / ref["ref-birder"]["step_s_mean"]
    )
    result = {
        "config": {"batches": {"tiny-mlp": [4]}, "seed_batches": {"tiny-mlp": [32]}, "nodes": 1, "nproc_per_node": 2},
        "profiles": {},
        "summary": summary,
    }
    assert "Birder hierarchical" in throughput.table(result)
    assert throughput.check_targets(summary) == []  # no targets for the tiny model
    paths = _load("plots").throughput_figures(result, tmp_path)
    assert [p.name for p in paths] == ["throughput_local.png", "throughput_local_breakdown.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


@pytest.mark.netns
def test_testbed_path_counts_link_bytes(tmp_path):
    ok, reason = throughput.testbed.available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {reason}")
    out = tmp_path / "t.json"
    args = ["--profiles", "ethernet", "--models", "tiny-mlp", "--batches", "tiny-mlp=4", "--rounds", "1"]
    args += ["--methods", "fp32-sgdm", "birder-hierarchical", "--no-refs", "--no-plots"]
    assert throughput.main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["method"]: r for r in result["summary"]}
    numel = next(r["numel"] for r in result["records"] if r["kind"] == "meta")
    # the fp32 gradient really crossed the shaped veth (4 bytes per value each way, plus headers)
    assert rows["fp32-sgdm"]["inter_node_tx_bytes_per_step"] > 4 * numel
    assert 0 < rows["birder-hierarchical"]["commstats_inter_bytes_per_step"] < numel / 4
    assert result["profiles"]["ethernet"]["bandwidth_mbit"]
    assert not any(n.startswith("birder-") and str(os.getpid()) in n for n in throughput.testbed._list_namespaces())


def test_cost_model_comm_bound_and_compute_bound(tmp_path):
    result = cost_model.run("tf32", tmp_path)  # no measured JSON there: calibrates from the fused-codec default
    pred = {(p["model"], p["batch"], p["network"], p["nodes"], p["method"]): p for p in result["predictions"]}
    # communication-bound: BERT-Base, 32 per GPU, 8 nodes on 10 GbE
    assert pred[("bert", 32, "10GbE", 8, "birder-hierarchical")]["speedup"] > 3
    # compute-bound: ResNet-50, 128 per GPU, 100 Gbit IB: nothing to win, nothing much lost
    assert pred[("resnet50", 128, "100G-IB", 2, "birder-hierarchical")]["speedup"] == pytest.approx(1.0, abs=0.05)
    # one node: no inter-node traffic at all, the codec is pure cost
    assert pred[("bert", 32, "10GbE", 1, "birder-hierarchical")]["speedup"] <= 1.0
    # the flat all-gather's bytes grow with the number of ranks; hierarchical's inter-node bytes grow with nodes
    a = cost_model.ASSUMPTIONS
    net = cost_model.NETWORKS["10GbE"]
    flat = [cost_model.comm_time("birder-allgather", 10**8, k, 8, net, a) for k in (2, 8)]
    hier = [cost_model.comm_time("birder-hierarchical", 10**8, k, 8, net, a) for k in (2, 8)]
    assert flat[1] / flat[0] > 3 and hier[1] < flat[1] / 4
    assert {"assumptions", "paper_comparison", "calibration"} <= set(result)


def test_hsdp_results_are_what_their_runs_say():
    # docs/results/hsdp_convergence.{json,md}: the summary and the table are computed from the stored runs
    conv = _load("hsdp_convergence")
    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    stored = json.loads((results / "hsdp_convergence.json").read_text())
    runs = stored["runs"]
    assert {r["method"] for r in runs} == set(conv.METHODS) and len({r["seed"] for r in runs}) == 3
    assert conv.summarize(runs) == stored["summary"]
    assert conv.table_markdown(stored["summary"], stored["settings"]) == (results / "hsdp_convergence.md").read_text()
    for r in runs:  # every run evaluated along the way and logged its training loss
        assert r["eval_steps"][-1] == stored["settings"]["steps"] and len(r["train_loss"]) >= 10


def test_memory_model_is_the_stored_table():
    memory = _load("memory")
    results = Path(__file__).resolve().parents[1] / "docs" / "results"
    stored = json.loads((results / "memory.json").read_text())
    provenance = {"report_commit", "command", "dirty", "stored_at_commit"}  # who wrote it, not the model's numbers
    assert memory.build(stored["recipe_config"], (2, 2), (4, 8)) == {
        k: v for k, v in stored.items() if k not in provenance
    }
    # the headline ratios: HSDP-Birder holds 28/L bytes per parameter, native HSDP with AdamW 16/L, DDP-Birder 24
    big = {r["method"]: r["bytes"] for r in stored["rows"] if r["model"] == "7B"}
    n = 7 * 10**9
    assert big["hsdp-birder"]["total_bytes"] == 28 * n // 8 and big["hsdp-adamw"]["total_bytes"] == 16 * n // 8
    assert big["ddp-birder"]["total_bytes"] == 24 * n


# ------------------------------------------------------------------------------------------------ time to accuracy
def _tta_files(work: Path, task: str, method: str, evals, step_s, link_bytes):
    common = {"task": task, "method": method, "steps": len(step_s), "seed": 0}
    curve = work / "curves" / f"{task}-{method}-seed0.jsonl"
    timed = work / "steptime" / f"{task}-{method}.jsonl"
    for path in (curve, timed):
        path.parent.mkdir(parents=True, exist_ok=True)
    lines = [{**common, "kind": "eval", "step": s, "train_s": 0.0, "perplexity": v} for s, v in evals]
    lines.append({**common, "kind": "done", "step_s": step_s})
    curve.write_text("".join(json.dumps(r) + "\n" for r in lines))
    link = {"kind": "link", "node0_tx_bytes": link_bytes, "steps": len(step_s)}
    timed.write_text(json.dumps({**common, "kind": "done", "step_s": step_s}) + "\n" + json.dumps(link) + "\n")


def test_tta_report_composes_the_clock_and_finds_the_time_to_target(tmp_path):
    tta = _load("tta")
    work = tmp_path / "work"
    lrs = {"lm": {"fp32": {"lr": 1e-3}, "birder-h": {"lr": 5e-4}, "powersgd-r4": {"lr": 1e-3}, "fp16": {"lr": 1e-3}}}
    (work / "tuned.json").parent.mkdir(parents=True)
    (work / "tuned.json").write_text(json.dumps(lrs))
    (work / "rates.json").write_text(json.dumps({"lm": {"rate_mbit": 40.0}}))
    evals = {  # perplexity after steps 0, 10, 20 (lower is better); fp32 ends at 100: the target is 100 / 0.95
        "fp32": [(0, 1000.0), (10, 200.0), (20, 100.0)],
        "birder-h": [(0, 1000.0), (10, 104.0), (20, 101.0)],
        "powersgd-r4": [(0, 1000.0), (10, 300.0), (20, 150.0)],
    }
    _tta_files(work, "lm", "fp32", evals["fp32"], [1.0] * 20, 20e6)
    _tta_files(work, "lm", "birder-h", evals["birder-h"], [0.25] * 20, 1e6)
    # 10 timed steps at 1 s (its fp32 warm-up half), then 10 at 0.5 s; 20 MB in all: 1 MB per fp32 step, 1 MB more
    _tta_files(work, "lm", "powersgd-r4", evals["powersgd-r4"], [1.0] * 10 + [0.5] * 10, 15e6)
    # a method run for twice the reference's steps (what a method cheap per step can afford in the same time)
    _tta_files(work, "lm", "fp16", [(0, 1000.0), (20, 150.0), (40, 100.0)], [0.5] * 40, 20e6)
    argv = ["report", "--tasks", "lm", "--methods", "fp32", "birder-h", "powersgd-r4", "fp16", "--seeds", "0"]
    argv += ["--validate", "--work", str(work), "--results", str(tmp_path / "results")]
    assert tta.main(argv) == 0
    result = json.loads((tmp_path / "results" / "tta.json").read_text())["tasks"]["lm"]
    m = result["methods"]
    assert result["target"] == pytest.approx(100 / 0.95)
    # Birder: 0.25 s a step, below the target at step 10 -> 2.5 s; fp32 reaches it at step 20 -> 20 s
    assert m["birder-h"]["seconds"] == [0.0, 2.5, 5.0] and m["birder-h"]["time_to_target_s"] == 2.5
    assert m["fp32"]["time_to_target_s"] == 20.0 and m["powersgd-r4"]["time_to_target_s"] is None
    # PowerSGD: its warm-up (10% of 20 steps = 2) at the fp32-phase step time, then compressed steps
    assert m["powersgd-r4"]["seconds"][1] == pytest.approx(2 * 1.0 + 8 * 0.5)
    assert m["powersgd-r4"]["link_mb_per_step"] == pytest.approx(2 * 0.75 - 1.0)
    # the budget is the fastest method's whole run (5 s): what each had reached by then
    assert result["budget_s"] == 5.0
    assert m["fp32"]["at_budget"] == 1000.0 and m["birder-h"]["at_budget"] == 101.0
    assert "| Birder hierarchical | 0.0005 |" in (tmp_path / "results" / "tta_table.md").read_text()
    assert (tmp_path / "results" / "tta.png").stat().st_size > 10_000
    assert result["steps"] == 20  # per task, from the reference's runs (tasks differ in steps and batch)
    # fp16 ran 40 steps: its clock runs on to 20 s, it reaches the target at step 40, and its row says how many
    assert m["fp16"]["run_steps"] == 40 and m["fp16"]["time_to_target_s"] == 20.0
    table = (tmp_path / "results" / "tta_table.md").read_text()
    assert "| fp16 hook, 40 steps |" in table and "| DDP fp32 |" in table and "20 steps of" in table
    # tasks are calibrated (and tuned) one invocation at a time: a second task's result keeps the first's
    tta._merge(work / "rates.json", {"qa": {"rate_mbit": 30.0}})
    assert json.loads((work / "rates.json").read_text()) == {"lm": {"rate_mbit": 40.0}, "qa": {"rate_mbit": 30.0}}
    # and a method tuned on its own keeps the learning rates of the task's other methods
    tta._merge(work / "tuned.json", {"lm": {"fp32": {"lr": 5e-4}, "birder-h": {"lr": 1e-3}}})
    tta._merge(work / "tuned.json", {"lm": {"local10": {"lr": 2e-3}}})
    assert {"birder-h", "fp32", "local10"} <= set(json.loads((work / "tuned.json").read_text())["lm"])
    assert json.loads((work / "tuned.json").read_text())["lm"]["fp32"] == {"lr": 5e-4}


def test_tta_local_steps_clock_is_per_round_and_restore_puts_a_report_back(tmp_path):
    tta = _load("tta")
    work = tmp_path / "work"
    # two ranks, H = 10, 30 timed steps: rank 0 computes a step in 0.1 s and waits 1.0 s at each exchange for rank 1,
    # which computes in 0.2 s and exchanges in 0.1 s; a round takes 2.0 s on both (the first round 5 s more: set-up)
    fast = ([0.1] * 9 + [1.1]) * 3
    slow = ([0.2] * 9 + [0.2]) * 3
    fast[9] += 5.0
    slow[9] += 5.0
    path = work / "steptime" / "qa-local10.jsonl"
    path.parent.mkdir(parents=True)
    record = {"kind": "done", "step_s": [max(a, b) for a, b in zip(fast, slow)], "step_s_per_rank": [fast, slow]}
    path.write_text(json.dumps(record) + "\n")
    args = tta.argparse.Namespace(work=work, slower=1)
    inner, outer = tta._phase_times("qa", "local10", args)
    assert inner == pytest.approx(0.15) and outer == pytest.approx(2.0 - 9 * 0.15)  # the slowest per step: 2.9 s
    clock = tta.phase_clock(inner, outer, "local10", 20, 0.1)
    assert clock[9] == pytest.approx(9 * 0.15) and clock[20] == pytest.approx(2 * 2.0)
    assert tta.local_steps("local10-fp32") == 10 and tta.local_steps("birder-h") == 0
    # restore: a stored report's curves become runs the report reads again, with the same numbers
    stored = {
        "config": {"seeds": [0, 1]},
        "rates": {"lm": {"rate_mbit": 40.0}},
        "tuned": {"lm": {"fp32": {"lr": 1e-3}}},
        "tasks": {"lm": {"steps": 20, "batch_per_proc": 4, "methods": {"fp32": {
            "lr": 1e-3, "steps": [0, 20], "per_seed": [[900.0, 100.0], [800.0, 110.0]],
            "loopback_s_per_step": [0.3, 0.4],
        }}}},
    }  # fmt: skip
    (tmp_path / "tta.json").write_text(json.dumps(stored))
    assert tta.main(["restore", "--work", str(work), "--restore-from", str(tmp_path / "tta.json")]) == 0
    assert json.loads((work / "tuned.json").read_text())["lm"]["local10"]["lr"] == 1e-3  # DDP fp32's rate
    runs = [tta.read(work / "curves" / f"lm-fp32-seed{seed}.jsonl") for seed in (0, 1)]
    assert [tta.final_metric(r, "lm") for r in runs] == [100.0, 110.0]
    assert [tta._loopback_step_s(r) for r in runs] == [0.3, 0.4]


def test_lr_protocol_times_each_row_on_its_own_clock(tmp_path):
    """A real-rank row (PowerSGD: its first 10% of the steps at the fp32 phase's rate) and a simulated Birder row,
    both timed from one steptime run; a seed that never reaches the target makes the worst 'not reached'."""
    protocol = _load("lr_protocol")
    work, results = tmp_path / "work", tmp_path / "results"
    results.mkdir()
    _tta_files(work, "qa", "powersgd-r4", [], [1.0] * 10 + [0.5] * 10, 0)
    _tta_files(work, "qa", "birder-h", [], [0.25] * 20, 0)

    def row(method, to_target):
        seeds = {
            str(s): {"final": 55.0, "step_to_target": t, "curve": {"steps": [0, 10, 20], "f1": [1.0, 51.0, 55.0]}}
            for s, t in zip((3, 4, 5), to_target, strict=True)
        }
        held = {"per_seed": seeds, "median": 55.0, "worst": 55.0, "reached": sum(t is not None for t in to_target)}
        tuning = {"0.002": {"median": 55.0, "disqualified": False}}
        return {"method": method, "steps": 20, "chosen": 0.002, "tuning": tuning, "held_out": held | {"seeds": 3}}

    store = {"target": 50.0, "protocol": "test", "methods": {"P": row("powersgd-r4", [10, 10, None]),
                                                             "B": row("2x2", [10, 20, 10])}}  # fmt: skip
    (results / "lr_protocol_qa.json").write_text(json.dumps(store))
    table = protocol.report("qa", results, work)
    times = {k: m["held_out"]["time_to_target_s"] for k, m in json.loads(
        (results / "lr_protocol_qa.json").read_text())["methods"].items()}  # fmt: skip
    # PowerSGD: warm-up max(2, 10% of 20) = 2 steps at 1 s, then 8 at 0.5 s; Birder: 10 and 20 steps at 0.25 s
    assert times["P"]["median"] == pytest.approx(2 * 1.0 + 8 * 0.5) and times["P"]["worst"] is None
    assert (times["B"]["median"], times["B"]["worst"]) == (2.5, 5.0)
    assert times["P"]["s_per_step"] == [1.0, 0.5] and "steptime" in times["P"]["source"]
    assert "| P | **0.002: 55.0** | 2 of 3 | 10 / not reached | 6 / not reached |" in table
    args = protocol._args("qa", "powersgd-r4", 2e-3, "{}", work, 600, 50)
    assert protocol._path(args, "powersgd-r4", 3).name == "qa-powersgd-r4-ranks4-lr0.002-seed3.jsonl"


def test_lr_protocol_rate_from_takes_another_rows_rate_and_runs_only_the_held_out_seeds(tmp_path):
    """``--rate-from``: a wrapper's row (PowerSGD around AdamW) takes the named row's chosen rate untuned; the held-out
    runs are read from finished files (nothing runs); an unknown row is a clear error that writes nothing."""
    protocol = _load("lr_protocol")
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    results.mkdir()
    store = {
        "task": "qa",
        "target": 53.4,
        "methods": {
            "A": {"method": "adamw", "chosen": 0.002, "tuning": {"0.002": {"median": 55.0, "disqualified": False}}}
        },
    }
    (results / "lr_protocol_qa_t.json").write_text(json.dumps(store))
    args = protocol._args("qa", "powersgd-r4", 0.002, "{}", work, 20, 10)
    for seed in protocol.HELD_OUT:
        lines = [{"kind": "eval", "step": s, "f1": v} for s, v in ((0, 1.0), (10, 40.0 + seed), (20, 60.0 + seed))]
        protocol._path(args, "powersgd-r4", seed).write_text(
            "".join(json.dumps(r) + "\n" for r in [*lines, {"kind": "done"}])
        )
    common = ["--task", "qa", "--method", "powersgd-r4", "--steps", "20", "--eval-every", "10", "--tag", "_t"]
    common += ["--work", str(work), "--results", str(results), "--label", "P"]
    with pytest.raises(SystemExit, match=r"--rate-from .B.: no row .* \(rows there: \[.A.\]\)"):
        protocol.main([*common, "--rate-from", "B"])
    assert json.loads((results / "lr_protocol_qa_t.json").read_text()) == store
    assert protocol.main([*common, "--rate-from", "A"]) == 0
    row = json.loads((results / "lr_protocol_qa_t.json").read_text())["methods"]["P"]
    assert (row["chosen"], row["rate_from"], row["tuning"], row["grid"]) == (0.002, "A", {}, [])
    held = row["held_out"]
    # every seed above the QA target (53.40) at step 20
    assert (held["median"], held["worst"], held["reached"], held["seeds"]) == (65.0, 63.0, 5, 5)
    assert [held["per_seed"][str(s)]["step_to_target"] for s in protocol.HELD_OUT] == [20] * 5
    assert "| P | 0.002: A's rate, not tuned | 5 of 5 | 20 / 20 |" in protocol.report("qa", results, None, "_t")


def test_seed_sweep_reads_later_seeds_of_every_protocol_row(tmp_path):
    """Held-out seeds from the protocol file, later seeds from run files (a real-rank row's own file name); a seed
    without a finished run is left out; times on the row's own clock."""
    sweep = _load("seed_sweep")
    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    results.mkdir()
    curve = {"steps": [0, 10, 20], "f1": [1.0, 51.0, 55.0]}
    row = {"method": "powersgd-r4", "options": {}, "warmup": 0.05, "steps": 20, "chosen": 0.002,
           "held_out": {"per_seed": {"3": {"final": 55.0, "step_to_target": 20, "curve": curve}}}}  # fmt: skip
    (results / "lr_protocol_qa_t.json").write_text(json.dumps({"methods": {"P": row}}))
    args = sweep.lr_protocol._args("qa", "powersgd-r4", 0.002, "{}", work, 20, 50)
    lines = [{"kind": "eval", "step": s, "f1": v} for s, v in ((0, 1.0), (10, 40.0), (20, 45.0))]
    sweep.lr_protocol._path(args, "powersgd-r4", 8).write_text(
        "".join(json.dumps(r) + "\n" for r in [*lines, {"kind": "done"}])
    )
    res = sweep.sweep("qa", [3, 8, 9], [work], results, "_t", None)["variants"]["P"]
    assert sorted(res["per_seed"]) == [3, 8]  # seed 9 has no run
    assert (res["reached"], res["missed"]) == (1, [8])  # 45 < the QA target (53.40)
    # docs/results/tta.json's PowerSGD rank 4 clock: 2 fp32-phase steps, then 18 compressed
    fp32_phase, compressed = res["clock"]["s_per_step"]
    assert res["time_to_target_median_s"] is None  # the median of (20, never) is never
    assert res["steps_to_target_worst"] == math.inf
    alone = sweep.sweep("qa", [3], [work], results, "_t", None)["variants"]["P"]
    assert alone["time_to_target_median_s"] == pytest.approx(2 * fp32_phase + 18 * compressed)


def test_recipe_matrix_reports_median_and_worst_seed_per_cell(tmp_path):
    # the report reads each run's all_results.json and trainer_state.json: median and worst seed per layout and
    # config (worst = lowest F1, highest perplexity), cells without runs left out; --report runs nothing
    matrix = _load("recipe_matrix")
    assert matrix.parse_config("adamw=--optimizer adamw") == ("adamw", ["--optimizer", "adamw"])
    assert matrix.parse_config("birder=") == ("birder", [])
    assert matrix.processes("1") == (1, 1) and matrix.processes("2x4") == (2, 4)
    with pytest.raises(SystemExit, match="NAME=RECIPE_ARGS"):
        matrix.parse_config("--beta 0.8")
    for seed, f1 in ((3, 50.0), (4, 40.0), (5, 60.0)):
        run = tmp_path / "work" / "qa" / f"1x2-birder-seed{seed}"
        run.mkdir(parents=True)
        (run / "all_results.json").write_text(json.dumps({"eval_f1": f1}))
        history = [{"step": 10, "loss": 2.0}, {"step": 20, "loss": 1.0}, {"step": 20, "train_runtime": 1.0}]
        (run / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    args = ["--task", "qa", "--layouts", "1x2", "2x2", "--seeds", "3", "4", "5", "--configs", "birder=", "adamw=x",
            "--work", str(tmp_path / "work"), "--results", str(tmp_path), "--report"]  # fmt: skip
    assert matrix.main(args) == 0
    res = json.loads((tmp_path / "recipe_matrix_qa.json").read_text())
    cell = res["cells"]["1x2"]["birder"]
    assert cell["median"] == 50.0 and cell["worst"] == 40.0 and cell["curves"]["3"]["loss"] == [2.0, 1.0]
    assert res["cells"]["1x2"].keys() == {"birder"} and res["cells"]["2x2"] == {}
    assert "| 1x2 | 2 | 3 | 50.0 / 40.0 |  |" in (tmp_path / "recipe_matrix_qa.md").read_text()
    assert (tmp_path / "recipe_matrix_qa.png").stat().st_size > 0
    # the image recipe (an accelerate loop, no Trainer) logs its own loss curve in all_results.json
    for seed, top1 in ((3, 90.0), (4, 80.0)):
        run = tmp_path / "work" / "image" / f"2x2-sgdm-seed{seed}"
        run.mkdir(parents=True)
        steps = [{"step": 10, "train_loss": 2.5}, {"step": 20, "train_loss": 1.5}]
        (run / "all_results.json").write_text(json.dumps({"final_val_top1": top1, "steps": steps}))
    args = ["--task", "image", "--layouts", "2x2", "--seeds", "3", "4", "--configs", "sgdm=--optimizer sgdm",
            "--work", str(tmp_path / "work"), "--results", str(tmp_path), "--report"]  # fmt: skip
    assert matrix.main(args) == 0
    cell = json.loads((tmp_path / "recipe_matrix_image.json").read_text())["cells"]["2x2"]["sgdm"]
    assert cell["median"] == 85.0 and cell["worst"] == 80.0 and cell["curves"]["4"]["loss"] == [2.5, 1.5]


def test_update_rule_ablation_runs_adams_rule_through_birders_step():
    # benchmarks/update_rule_ablation.py's claim: its "adam" variant, swapped into Birder's encoder and stepped with
    # d = u, is torch.optim.Adam (no weight decay), and "adam-bounded" is that direction clipped to [-1, 1]
    import torch

    import birder_hf.optim
    from birder_hf import Birder

    ablation = _load("update_rule_ablation")
    original = birder_hf.optim.birder_encode
    torch.manual_seed(0)
    # gradients that grow after a long quiet history: Adam's v remembers the quiet steps, so it steps beyond lr
    base = torch.randn(5, 3)
    grads = [base * (0.1 if t < 50 else 1.0) + 0.01 * torch.randn(5, 3) for t in range(60)]
    try:
        for bounded in (False, True):
            birder_hf.optim.birder_encode = ablation._adam_encode(bounded=bounded)
            ours, ref = torch.nn.Parameter(torch.ones(5, 3)), torch.nn.Parameter(torch.ones(5, 3))
            opt = Birder([ours], lr=0.01, quantize=False, weight_decay=0.0)
            adam = torch.optim.Adam([ref], lr=0.01, betas=(0.9, 0.999), eps=1e-8)
            largest = 0.0
            for g in grads:
                before = ours.detach().clone()
                ours.grad, ref.grad = g.clone(), g.clone()
                opt.step()
                adam.step()
                largest = max(largest, float((ours.detach() - before).abs().max()) / 0.01)
            if bounded:
                assert largest == pytest.approx(1.0) and not torch.allclose(ours, ref, rtol=1e-4)
            else:
                assert largest > 1.5  # a step beyond lr, which Birder's |u| <= 1 never takes
                torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    finally:
        birder_hf.optim.birder_encode = original
