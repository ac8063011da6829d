"""The convergence benchmark (``benchmarks/convergence.py``), CI-sized: Birder's loss falls like AdamW's on both tasks.

One seed, 2 processes (2 simulated nodes x 1, hierarchical 1-bit all-reduce), a few steps, through the benchmark's
own functions (plan, launch, collect, summarize, plot); the full benchmark and its results are in
``docs/CONVERGENCE.md``.
"""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("convergence", os.path.join(ROOT, "benchmarks", "convergence.py"))
convergence = importlib.util.module_from_spec(_spec)
sys.modules["convergence"] = convergence  # dataclasses look their module up
_spec.loader.exec_module(convergence)

# Birder's loss must fall by at least this fraction of AdamW's fall over the same steps (both must fall).
MIN_RELATIVE_DROP = 0.5


def _ci_config(task):
    return convergence.Config(
        seeds=[0],
        tasks=[task],
        methods=["birder-h", "adamw"] + (["onebitadam"] if task == "bert" else []),
        nproc=2,
        num_nodes=2,
        bert_steps=20,
        bert_logging_steps=5,
        bert_extra=["--embedded_num_train", "800", "--embedded_num_eval", "40"],
        resnet_model="test_resnet",
        resnet_epochs=2,
        resnet_batch=64,
    )


@pytest.mark.parametrize("task", ["bert", "resnet"])
def test_birder_loss_falls_like_adamw(task, tmp_path):
    result = convergence.run_benchmark(_ci_config(task), tmp_path / "runs", tmp_path / "results")
    assert not result["failed"]
    ratios = {r["method"]: convergence.loss_ratio(r) for r in result["runs"]}
    assert ratios["adamw"] < 1.0, ratios
    assert ratios["birder-h"] < 1.0, ratios
    assert 1.0 - ratios["birder-h"] >= MIN_RELATIVE_DROP * (1.0 - ratios["adamw"]), ratios

    # what the benchmark writes: JSON of all numbers, the table, one figure per task
    with open(tmp_path / "results" / "convergence_results.json") as f:
        saved = json.load(f)
    assert set(saved["summary"][task]["methods"]) == set(_ci_config(task).methods)
    assert saved["summary"][task]["target"]["birder-h"]["best_baseline"] == "adamw"
    assert "± " in (tmp_path / "results" / "convergence_table.md").read_text()
    assert (tmp_path / "results" / f"convergence_{task}.png").stat().st_size > 10_000
    birder = next(r for r in saved["runs"] if r["method"] == "birder-h")
    assert birder["comm/compression_ratio"] > 10  # the 1-bit hook really ran
    if task == "bert":  # 1-bit Adam through the recipe: warm-up (fp32 volume), then compressed
        onebit = next(r for r in saved["runs"] if r["method"] == "onebitadam")
        assert ratios["onebitadam"] < 1.0 and 1.5 < onebit["comm/compression_ratio"] < 10, onebit

    # resumable: a second call reads the finished runs instead of running them again
    again = convergence.run_benchmark(_ci_config(task), tmp_path / "runs", None)
    assert [r["wall_s"] for r in again["runs"]] == [None] * len(_ci_config(task).methods)


def _record(task, method, seed, final, loss):
    return {
        "task": task,
        "method": method,
        "seed": seed,
        "final": final,
        "loss_steps": [1, 2],
        "loss": loss,
        "val_steps": [],
        "val": [],
    }


def test_summary_and_target_check():
    recs = [
        _record("resnet", "sgdm", 0, {"val_top1": 90.0}, [2.0, 1.0]),
        _record("resnet", "sgdm", 1, {"val_top1": 92.0}, [2.0, 1.0]),
        _record("resnet", "adamw", 0, {"val_top1": 80.0}, [2.0, 1.0]),
        _record("resnet", "birder-h", 0, {"val_top1": 89.5}, [2.0, 0.5]),
        _record("resnet", "birder-flat", 0, {"val_top1": 88.0}, [2.0, 0.5]),
    ]
    s = convergence.summarize(recs)["resnet"]
    assert s["methods"]["sgdm"]["val_top1"]["mean"] == pytest.approx(91.0)
    assert s["methods"]["sgdm"]["val_top1"]["std"] == pytest.approx(2**0.5)
    assert s["methods"]["birder-h"]["loss_ratio"]["mean"] == pytest.approx(0.25)
    # best baseline is SGDM (91.0); tolerance max(1 point, seed spread 1.41)
    h, flat = s["target"]["birder-h"], s["target"]["birder-flat"]
    assert h["best_baseline"] == "sgdm" and h["gap"] == pytest.approx(1.5) and not h["met"]
    assert flat["gap"] == pytest.approx(3.0) and not flat["met"]
    recs[3]["final"]["val_top1"] = 90.0
    assert convergence.summarize(recs)["resnet"]["target"]["birder-h"]["met"]


def test_plan_same_data_and_budget_for_every_method():
    cfg = convergence.Config(seeds=[0, 1])
    runs = convergence.plan_runs(cfg)
    assert [r.seed for r in runs] == sorted(r.seed for r in runs)  # seed-major: partial runs stay balanced
    bert = {r.method for r in runs if r.task == "bert"}
    assert bert == {"birder-h", "birder-flat", "adamw", "birder-1p", "onebitadam"}
    resnet = [r for r in runs if r.task == "resnet" and r.seed == 0]
    assert {r.method for r in resnet} == {"birder-h", "birder-flat", "adamw", "sgdm", "birder-1p", "onebitadam"}
    for r in resnet:
        epochs = r.args[r.args.index("--epochs") + 1]
        batch = int(r.args[r.args.index("--batch_size") + 1])
        assert epochs == str(cfg.resnet_epochs) and batch * r.nproc == 128  # same budget and global batch
    for r in runs:
        assert "--quantize" not in r.args or (r.method == "birder-1p" and r.nproc == 1)
    one = next(r for r in runs if r.task == "resnet" and r.method == "birder-1p")
    assert one.nproc == 1 and one.args[one.args.index("--quantize") + 1] == "False"
    onebit = next(r for r in runs if r.task == "bert" and r.method == "onebitadam")
    freeze = int(onebit.args[onebit.args.index("--freeze_step") + 1])
    assert freeze == round(0.2 * cfg.bert_steps) and "--learning_rate" in onebit.args
    hier = next(r for r in runs if r.method == "birder-h")
    assert "--num_nodes" in hier.args and "hierarchical" in hier.args
