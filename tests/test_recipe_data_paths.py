"""The recipes' real-data and multi-machine paths that the docs promise, run on data written in the real formats.

The Hub is unreachable in CI, so `--dataset_name squad` itself (the download) is not exercised; the same
`load_dataset(name)` call is, with a local dataset folder, and so are `--model_name_or_path` (a saved model
folder), `--train_file/--validation_file` (SQuAD v1.1 JSON), `--data_dir` (an ImageNet-style folder) and two
`accelerate launch --num_machines 2` launchers on one host (recipes/README.md).
"""

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))

import embedded_data  # noqa: E402

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": ROOT + "/src"}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv, timeout=300, **env):
    res = subprocess.run(
        argv, cwd=ROOT, env={**os.environ, **ENV, **env}, capture_output=True, text=True, timeout=timeout
    )
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-6000:]
    return log


def _results(out):
    with open(os.path.join(out, "all_results.json")) as f:
        return json.load(f)


def _question_ids(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)["data"]
    return {qa["id"] for article in data for p in article["paragraphs"] for qa in p["qas"]}


def test_bert_recipe_squad_json_files_then_a_local_dataset_and_a_saved_model(tmp_path):
    train_json, dev_json = embedded_data.make_squad_dataset(tmp_path / "squad", 200, 40, seed=0)
    # 1) --train_file / --validation_file: SQuAD v1.1 JSON, as the real train-v1.1.json / dev-v1.1.json
    a = str(tmp_path / "a")
    argv = [sys.executable, "recipes/bert_base.py", "--max_steps", "2", "--output_dir", a]
    _run([*argv[:-2], "--train_file", str(train_json), "--validation_file", str(dev_json), "--output_dir", a])
    assert _results(a)["world_size"] == 1 and "eval_f1" in _results(a)
    with open(os.path.join(a, "eval_predictions.json")) as f:
        assert set(json.load(f)) == _question_ids(dev_json)  # evaluated on the given file, not the embedded set
    assert not os.path.exists(os.path.join(a, "embedded_squad"))

    # 2) --dataset_name goes through datasets.load_dataset(name), as for "squad"; here a local folder with the
    #    Hub dataset's columns and split names. --model_name_or_path loads model and tokenizer from run 1.
    hub_like = tmp_path / "hub_like"
    hub_like.mkdir()
    embedded_data.load_squad_json(train_json).to_json(str(hub_like / "train.jsonl"))
    embedded_data.load_squad_json(dev_json).to_json(str(hub_like / "validation.jsonl"))
    b = str(tmp_path / "b")
    _run([*argv[:-2], "--dataset_name", str(hub_like), "--model_name_or_path", a, "--output_dir", b])
    assert "eval_f1" in _results(b)
    with open(os.path.join(b, "eval_predictions.json")) as f:
        assert set(json.load(f)) == _question_ids(dev_json)
    with open(os.path.join(a, "tokenizer.json"), "rb") as fa, open(os.path.join(b, "tokenizer.json"), "rb") as fb:
        assert fa.read() == fb.read()  # the saved model's tokenizer, not a newly built one
    assert not os.path.exists(os.path.join(b, "embedded_tokenizer"))

    # the model cards: run 1 trained from scratch, run 2 fine-tuned a local checkpoint (no huggingface.co/<path> link)
    card_a = open(os.path.join(a, "README.md"), encoding="utf-8").read()
    card_b = open(os.path.join(b, "README.md"), encoding="utf-8").read()
    assert "This model was trained from scratch on" in card_a and "huggingface.co/)" not in card_a
    assert "fine-tuned version of a local checkpoint (`a`)" in card_b
    assert "huggingface.co/" + str(tmp_path).lstrip("/") not in card_b and "base_model" not in card_b


def test_resnet_recipe_reads_an_imagenet_style_data_dir(tmp_path):
    data = embedded_data.write_digits_image_folder(str(tmp_path / "images"), image_size=32)
    out = str(tmp_path / "resnet")
    log = _run(
        [
            sys.executable,
            "recipes/resnet50.py",
            "--data_dir",
            data,
            "--image_size",
            "32",
            "--model",
            "resnet18",
            "--max_steps",
            "2",
            "--epochs",
            "1",
            "--save_every_epochs",
            "0",
            "--output_dir",
            out,
        ]
    )
    results = _results(out)
    assert results["final_step"] == 2 and 0 <= results["final_val_top1"] <= 100
    assert not os.path.exists(os.path.join(out, "embedded_digits"))  # read --data_dir, wrote nothing of its own
    assert data in open(os.path.join(out, "model", "README.md")).read(), log[-2000:]


def test_two_accelerate_launchers_simulate_two_machines(tmp_path):
    # recipes/README.md: two launchers with --num_machines 2 on one host set LOCAL_WORLD_SIZE=2 and
    # GROUP_RANK=0/1 as on a cluster, and Birder's topology becomes 2 nodes x 2 ranks
    port, out = str(_free_port()), str(tmp_path / "2x2")
    procs = []
    for rank in ("0", "1"):
        argv = ["accelerate", "launch", "--multi_gpu", "--num_machines", "2", "--num_processes", "4"]
        argv += ["--machine_rank", rank, "--main_process_ip", "127.0.0.1", "--main_process_port", port]
        argv += ["recipes/bert_base.py", "--hierarchy", "--max_steps", "2", "--output_dir", out]
        argv += ["--embedded_num_train", "200", "--embedded_num_eval", "20"]
        env = {**os.environ, **ENV, "ACCELERATE_USE_CPU": "1"}
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-6000:]
    assert "Topology(2 nodes x 2 ranks, rank 0)" in logs[0]
    assert "Topology(2 nodes x 2 ranks, rank 2)" in logs[1]  # the second launcher's first rank is on node 1
    results = _results(out)
    assert results["world_size"] == 4 and results["comm/topology"].startswith("Topology(2 nodes x 2 ranks")
    assert results["comm/inter_node_bytes"] > 0
