"""The recipes end to end, through the real launchers (torchrun, accelerate launch) on CPU processes."""

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv, timeout=600, **env):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT + "/src", **env}
    res = subprocess.run(argv, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-6000:]
    return log


def _torchrun(nproc, script, *args):
    return _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(_free_port()),
            script,
            *args,
        ]
    )


BERT_TINY = [
    "--embedded_num_train",
    "800",
    "--embedded_num_eval",
    "100",
    "--per_device_train_batch_size",
    "16",
    "--logging_steps",
    "10",
]


def test_bert_recipe_learns_with_the_hierarchical_hook(tmp_path):
    out = str(tmp_path / "bert")
    log = _torchrun(
        2, "recipes/bert_base.py", *BERT_TINY, "--max_steps", "80", "--num_nodes", "2", "--output_dir", out
    )
    results = json.load(open(os.path.join(out, "all_results.json")))
    assert results["world_size"] == 2 and results["optimizer"] == "birder"
    assert results["comm/topology"].startswith("Topology(2 nodes x 1 rank")
    assert "1-bit hierarchical hook registered" in log
    assert results["comm/inter_node_bytes"] > 0 and results["comm/compression_ratio"] > 30
    # an untrained model scores F1 ~5 on this data and 80 steps reach ~13: F1 > 9 needs learning
    assert results["eval_f1"] > 9, results
    losses = [
        e["loss"] for e in json.load(open(os.path.join(out, "trainer_state.json")))["log_history"] if "loss" in e
    ]
    assert losses[-1] < 0.75 * losses[0], losses
    for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md", "eval_predictions.json"):
        assert os.path.isfile(os.path.join(out, name)), name
    assert "EM " in log and "less" in log  # the summary line with the bytes saved
    _check_model_card(os.path.join(out, "README.md"), results)


def test_bert_recipe_local_steps_exchange_every_h_steps(tmp_path):
    # --local_steps 3 over 8 steps on 2 nodes x 1: 2 outer steps, then the partial round when training ends
    out = str(tmp_path / "local")
    flags = ["--optimizer", "adamw", "--local_steps", "3", "--num_nodes", "2", "--max_steps", "8"]
    log = _torchrun(2, "recipes/bert_base.py", *BERT_TINY, *flags, "--output_dir", out)
    results = json.load(open(os.path.join(out, "all_results.json")))
    assert results["outer_steps"] == 3 and results["comm/topology"].startswith("Topology(2 nodes x 1 rank")
    assert results["comm/method"] == "local_steps 3, outer exchange onebit"
    # 8 inner steps' worth of DDP traffic against 3 exchanges of 1 bit per parameter (and one fp32 scale per tensor)
    assert results["comm/compression_ratio"] > 8 / 3 * 32 * 0.9, results
    assert "less" in log


@pytest.mark.parametrize("name", ["bert_base", "causal_lm"])
def test_recipe_local_steps_arguments(name):
    recipe = _recipe_module(name)
    local = ["--optimizer", "adamw", "--local_steps", "10"]
    _, _, opt, _ = recipe.parse_args([*local, "--num_nodes", "2"])
    assert (opt.local_steps, opt.outer_num_nodes, opt.outer_exchange) == (10, 2, "onebit")
    # the 1-bit exchange's outer step as chosen on each task's own seeds; what a command line gives is kept
    assert (opt.outer_lr, opt.outer_momentum) == ((1.0, 0.0) if name == "causal_lm" else (0.7, 0.5))
    assert recipe.parse_args([*local, "--outer_momentum", "0.5"])[2].outer_momentum == 0.5
    assert recipe.parse_args([*local, "--outer_exchange", "fp32"])[2].outer_lr == 0.7
    with pytest.raises(ValueError, match="--local_steps runs an uncompressed inner optimizer.*--optimizer adamw"):
        recipe.parse_args(["--local_steps", "10"])
    with pytest.raises(ValueError, match="local_steps=-1"):
        recipe.parse_args(["--optimizer", "adamw", "--local_steps", "-1"])


def _check_model_card(path, results):
    """The card a user of the published checkpoint reads: the configured lr (the schedule ends at 0), only Birder's
    settings, EM/F1 in model-index, and "trained from scratch" (no link to an empty base model)."""
    import yaml

    text = open(path, encoding="utf-8").read()
    meta = yaml.safe_load(text.split("---")[1])
    assert "Trained with Birder" in text and "This model was trained from scratch on" in text
    assert "- optimizer: Birder (1-bit adaptive" in text and "lr=0.002," in text and "| lr | 0.002 |" in text
    assert "freeze_step" not in text and "huggingface.co/)" not in text and "base_model" not in meta
    (index,) = meta["model-index"]
    scores = {m["type"]: m["value"] for r in index["results"] for m in r["metrics"]}
    assert scores == {"exact_match": round(results["eval_exact_match"], 4), "f1": round(results["eval_f1"], 4)}
    assert index["results"][0]["task"]["type"] == "question-answering"


def _recipe_module(name):
    """recipes/<name>.py imported as a module, once (its dataclasses look their module up in sys.modules)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "recipes", f"{name}.py"))
    sys.modules.setdefault(name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


@pytest.mark.parametrize("name", ["bert_base", "causal_lm"])
def test_recipe_arguments_save_steps_alone_writes_checkpoints_and_numbers_are_finite(name):
    # causal_lm's --save_steps N used to leave save_strategy "no": an elastic restart (auto) started from step 0
    recipe = _recipe_module(name)
    strategy = lambda *argv: recipe.parse_args(list(argv))[-1].save_strategy.value  # noqa: E731
    assert strategy() == "no"  # the recipe's default: no checkpoints
    assert strategy("--save_steps", "5") == "steps"  # asked for checkpoints: gets them (was: none)
    assert strategy("--save_steps=5") == "steps"
    assert strategy("--save_steps", "5", "--save_strategy", "no") == "no"  # an explicit choice stands
    for flag in ("--warmup_steps", "--learning_rate", "--weight_decay"):  # nan failed later, with a traceback
        with pytest.raises(ValueError, match=f"{flag} must be a finite number >= 0, got nan"):
            recipe.parse_args([flag, "nan"])
    # an unwritable folder failed with a traceback while the data was prepared, or at the first checkpoint
    flags = ["--output_dir"] + (["--cache_dir"] if name == "causal_lm" else [])
    with tempfile.NamedTemporaryFile() as file:
        for flag in flags:
            with pytest.raises(ValueError, match=f"{flag} {file.name}/sub: {file.name} is a file; choose a folder"):
                recipe.parse_args([flag, f"{file.name}/sub"])
    if os.path.isdir("/proc/sys") and not os.access("/proc/sys", os.W_OK):  # a read-only mount (even for root)
        with pytest.raises(ValueError, match="--output_dir /proc/sys/birder: /proc/sys is not writable"):
            recipe.parse_args(["--output_dir", "/proc/sys/birder"])


def test_causal_lm_update_rule_supplies_only_what_the_command_line_leaves_out(monkeypatch):
    recipe = _recipe_module("causal_lm")

    def rule(*argv, world=2, local=2):
        _, _, opt, training = recipe.parse_args(list(argv))  # one process: the Trainer's arguments see no launcher
        with monkeypatch.context() as env:  # what accelerate launch / torchrun set, for the rule alone
            env.setenv("WORLD_SIZE", str(world))
            env.setenv("LOCAL_WORLD_SIZE", str(local))
            recipe.apply_rule_defaults(list(argv), opt, training)
        return opt.beta, opt.beta2, opt.grad_clip, training.learning_rate

    # the default: Adam's direction, clipped, at 1e-3 per voting worker (every rank under DDP, every node under HSDP);
    # beta by the voting ranks under DDP, where each was chosen (0.8 at 2, 0.85 at 4), the rule's 0.9 elsewhere
    assert rule() == (0.8, 0.999, 1.0, 2e-3)
    assert rule(world=4) == (0.85, 0.999, 1.0, 4e-3)
    assert rule(world=3, local=3)[0] == 0.8 and rule(world=16, local=8)[0] == 0.85  # the nearest measured below
    assert rule(world=1, local=1) == (0.9, 0.999, 1.0, 1e-3)
    assert rule("--sharding", "hsdp", world=4, local=2)[0] == 0.9  # 2 voting nodes: not run at these
    assert rule(world=16, local=8)[-1] == 4e-3  # beyond 4 voters: the largest rate measured
    assert rule("--sharding", "hsdp", world=4, local=4)[-1] == 1e-3  # 4 ranks of one node: one voter
    assert rule("--sharding", "hsdp", world=4, local=2)[-1] == 2e-3  # 2 nodes of 2
    assert rule("--sharding", "hsdp", "--num_nodes", "2", world=4, local=4)[-1] == 2e-3  # simulated nodes
    assert rule("--update_rule", "birder", world=4) == (0.95, None, None, 5e-4)  # the paper's m / b
    assert rule("--beta", "0.95", "--learning_rate", "1e-3") == (0.95, 0.999, 1.0, 1e-3)  # a given flag stands
    assert rule("--update_rule=birder", "--beta=0.9") == (0.9, None, None, 5e-4)
    assert rule("--optimizer", "adamw", world=4)[-1] == 2e-3
    _, _, opt, _ = recipe.parse_args([])
    assert opt.defaults_note == "learning rate 0.001: 0.001 per voting worker, 1 voting"  # what the run logs
    # a given rate is logged as given, beside the rule's beta
    _, _, opt, training = recipe.parse_args(["--learning_rate", "3e-3"])
    with monkeypatch.context() as env:
        env.setenv("WORLD_SIZE", "4")
        env.setenv("LOCAL_WORLD_SIZE", "2")
        recipe.apply_rule_defaults(["--learning_rate", "3e-3"], opt, training)
    assert opt.defaults_note == "beta 0.85: the rule's at 4 voting ranks, 4 voting; learning rate 0.003: given"
    with pytest.raises(ValueError, match="--update_rule birder votes on m / b without clipping; drop --beta2"):
        recipe.parse_args(["--update_rule", "birder", "--grad_clip", "1.0"])
    with pytest.raises(ValueError, match="--update_rule 'sgd'; choose one of adam, birder"):
        recipe.parse_args(["--update_rule", "sgd"])


def test_bert_recipe_settings_follow_the_voting_workers_unless_given(monkeypatch):
    recipe = _recipe_module("bert_base")

    def rule(*argv, world=2, local=2):
        _, _, opt, _ = recipe.parse_args(list(argv))  # one process: the Trainer's arguments see no launcher
        with monkeypatch.context() as env:  # what accelerate launch / torchrun set, for the rule alone
            env.setenv("WORLD_SIZE", str(world))
            env.setenv("LOCAL_WORLD_SIZE", str(local))
            opt.rule_note = ""
            recipe.apply_voter_rule(list(argv), opt)
        return opt.beta, opt.stale, opt.rule_note

    two, four = recipe.RULE_BY_VOTERS[2], recipe.RULE_BY_VOTERS[4]
    assert rule() == (two["beta"], two["stale"], f"beta {two['beta']:g}, stale {two['stale']}: chosen at 2 voting "
                      "workers, 2 voting")  # fmt: skip
    assert rule(world=4)[:2] == (four["beta"], four["stale"])
    assert rule(world=1, local=1)[:2] == rule(world=3, local=3)[:2] == rule()[:2]  # fewer than measured, or between
    assert rule(world=32, local=8)[2].endswith("chosen at 4 voting workers, 32 voting")  # more: the largest's
    assert rule("--sharding", "hsdp", world=4, local=2)[:2] == rule()[:2]  # 2 nodes of 2 ranks: 2 voters
    assert rule("--beta", "0.95", world=4) == (0.95, four["stale"], f"stale {four['stale']}: chosen at 4 voting "
                "workers, 4 voting")  # fmt: skip  # a given flag stands
    assert rule("--beta=0.7", "--stale", "lazy") == (0.7, "lazy", "")
    assert rule("--optimizer", "adamw")[2] == ""  # no Birder, no rule
    _, _, opt, _ = recipe.parse_args([])
    assert opt.rule_note.endswith("chosen at 2 voting workers, 1 voting")  # what the run logs


def test_bert_recipe_baseline_and_bad_arguments(tmp_path):
    out = str(tmp_path / "adamw")
    _run(
        [
            sys.executable,
            "recipes/bert_base.py",
            *BERT_TINY,
            "--max_steps",
            "2",
            "--optimizer",
            "adamw",
            "--output_dir",
            out,
        ]
    )
    results = json.load(open(os.path.join(out, "all_results.json")))
    assert results["optimizer"] == "adamw" and "comm/compression_ratio" not in results
    bad = subprocess.run(
        [sys.executable, "recipes/bert_base.py", "--optimizer", "lamb", "--output_dir", out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT + "/src"},
    )
    assert bad.returncode != 0 and "choose one of birder, onebitadam, adamw, sgdm" in bad.stderr


def test_resnet_recipe_through_accelerate_launch(tmp_path):
    out = str(tmp_path / "resnet")
    log = _run(
        [
            "accelerate",
            "launch",
            "--config_file",
            "accelerate_configs/cpu.yaml",
            "--num_processes",
            "2",
            "--main_process_port",
            str(_free_port()),
            "recipes/resnet50.py",
            "--model",
            "resnet18",
            "--epochs",
            "2",
            "--batch_size",
            "32",
            "--output_dir",
            out,
        ],
        ACCELERATE_USE_CPU="1",
    )
    results = json.load(open(os.path.join(out, "all_results.json")))
    assert results["world_size"] == 2 and "1-bit hierarchical hook registered" in log
    assert results["final_val_top1"] > 25, results  # 10 classes: chance is 10%
    assert results["final_comm/compression_ratio"] > 30
    assert len(results["epochs"]) == 2
    assert os.path.isfile(os.path.join(out, "model", "model.safetensors"))
    assert "Trained with Birder" in open(os.path.join(out, "model", "README.md")).read()
    assert sorted(os.listdir(os.path.join(out, "checkpoint-44", "birder"))) == [
        "rank_00000-of-00002.pt",
        "rank_00001-of-00002.pt",
    ]
    # the step is saved inside save_state, so the completion marker covers it (recipe_state.json came after it), and
    # --resume_from_checkpoint auto resumes from the newest complete checkpoint
    marker = json.load(open(os.path.join(out, "checkpoint-44", "birder_complete.json")))
    assert "custom_checkpoint_1.pkl" in marker["files"]
    shutil.rmtree(os.path.join(out, "checkpoint-44"))  # the job was killed before its second epoch's checkpoint
    log = _run(
        ["accelerate", "launch", "--config_file", "accelerate_configs/cpu.yaml", "--num_processes", "2",
         "--main_process_port", str(_free_port()), "recipes/resnet50.py", "--model", "resnet18", "--epochs", "2",
         "--batch_size", "32", "--output_dir", out, "--resume_from_checkpoint", "auto"],
        ACCELERATE_USE_CPU="1",
    )  # fmt: skip
    assert f"Resuming from {out}/checkpoint-22" in log
    resumed = json.load(open(os.path.join(out, "all_results.json")))
    assert [e["step"] for e in resumed["epochs"]] == [44]  # only the second epoch ran


LM_TINY = [
    "--max_files",
    "40",
    "--vocab_size",
    "512",
    "--block_size",
    "32",
    "--max_eval_blocks",
    "16",
    "--per_device_train_batch_size",
    "4",
    "--warmup_steps",
    "0",
    "--learning_rate",  # a few steps must show learning (the paper's rule's 5e-4 suits 150 steps, not 6)
    "2e-3",
    "--logging_steps",
    "2",
    "--eval_steps",
    "3",
]


def _memory_model():
    import importlib.util

    spec = importlib.util.spec_from_file_location("memory", os.path.join(ROOT, "benchmarks", "memory.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_memory_is_the_model(results, method):
    # what the recipe counted on rank 0 is what benchmarks/memory.py computes for the same model and layout
    memory = _memory_model()
    shapes = memory.gpt2_shapes(n_embd=128, n_layer=4, n_head=4, vocab_size=512, n_positions=32)
    want = memory.per_rank_bytes(method, shapes, 2)
    for key in ("param_bytes", "grad_bytes", "optimizer_state_bytes", "comm_buffer_bytes"):
        assert results[f"memory/{key}"] == want[key], (key, results[f"memory/{key}"], want[key])


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


def test_causal_lm_recipe_1bit_hsdp_trains_saves_and_resumes_exactly(tmp_path):
    data = ["--cache_dir", str(tmp_path / "data")]
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    ckpt = ["--save_strategy", "steps", "--save_steps", "3", "--max_steps", "6"]
    # 2 micro-batches per step: FSDP reduce-scatters (and the hook runs) once per step
    hsdp = ["--sharding", "hsdp", "--num_nodes", "2", "--gradient_accumulation_steps", "2"]
    log = _torchrun(4, "recipes/causal_lm.py", *LM_TINY, *hsdp, *ckpt, *data, "--output_dir", straight)
    results = json.load(open(os.path.join(straight, "all_results.json")))
    assert results["world_size"] == 4 and results["sharding"] == "hsdp" and results["optimizer"] == "birder"
    assert "1-bit hierarchical FSDP hook across 2 nodes" in log
    assert results["comm/topology"].startswith("Topology(2 nodes x 1 rank") and results["comm/intra_node_bytes"] == 0
    assert results["comm/compression_ratio"] > 30  # against an fp32 all-reduce of the same shard across the nodes
    # each rank holds half the model (2 ranks per node) and m, b for its half
    assert results["memory/param_bytes"] < 0.6 * 4 * results["num_parameters"]
    _assert_memory_is_the_model(results, "hsdp-birder")
    assert results["eval_loss"] < 0.95 * math.log(512)  # an untrained model predicts ~uniformly over 512 tokens
    assert sorted(os.listdir(os.path.join(straight, "checkpoint-3", "birder"))) == [
        f"rank_0000{r}-of-00004.pt" for r in range(4)
    ]
    for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md", "data_manifest.json"):
        assert os.path.isfile(os.path.join(straight, name)), name
    assert "Trained with Birder" in open(os.path.join(straight, "README.md")).read()
    assert "validation perplexity" in log
    # a new launch resumes from step 3 and ends where the uninterrupted run ended, bit for bit
    resume = ["--resume_from_checkpoint", os.path.join(straight, "checkpoint-3")]
    _torchrun(4, "recipes/causal_lm.py", *LM_TINY, *hsdp, *ckpt, *data, *resume, "--output_dir", resumed)
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_causal_lm_recipe_native_hsdp_baseline_and_bad_arguments(tmp_path):
    out = str(tmp_path / "adamw")
    data = ["--cache_dir", str(tmp_path / "data")]
    hsdp = ["--sharding", "hsdp", "--num_nodes", "2", "--optimizer", "adamw", "--max_steps", "2"]
    hsdp += ["--gradient_accumulation_steps", "2"]
    _torchrun(4, "recipes/causal_lm.py", *LM_TINY, *hsdp, *data, "--output_dir", out)
    results = json.load(open(os.path.join(out, "all_results.json")))
    assert results["optimizer"] == "adamw" and "comm/compression_ratio" not in results
    _assert_memory_is_the_model(results, "hsdp-adamw")  # sharded AdamW state, no Birder buffers
    bad = subprocess.run(
        [
            sys.executable,
            "recipes/causal_lm.py",
            "--sharding",
            "hsdp",
            "--optimizer",
            "onebitadam",
            "--output_dir",
            out,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT + "/src"},
    )
    assert bad.returncode != 0 and "onebitadam runs with DDP only" in bad.stderr
