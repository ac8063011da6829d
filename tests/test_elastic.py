"""Elastic restarts: a checkpoint counts only once complete on every rank, and ``--resume_from_checkpoint auto``
resumes from the newest such one by itself, under torchrun's elastic agent with real SIGKILLs
(tests/_elastic_script.py).
"""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from test_recipes import BERT_TINY, LM_TINY, ROOT, _free_port, _torchrun

from birder_hf import Birder
from birder_hf.checkpoint import MARKER, SUBDIR, file_sha256, load_rank_state, save_rank_state
from birder_hf.elastic import checkpoint_problem, find_resumable_checkpoint, mark_checkpoint_complete


def _checkpoint(folder, *, world_size=1, marked=True):
    opt = Birder([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    os.makedirs(folder)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(b"x" * 100)
    for rank in range(world_size):
        save_rank_state(opt, folder, rank=rank, world_size=world_size)
    if marked:
        mark_checkpoint_complete(folder, rank=0, world_size=world_size)
    return folder


def test_the_newest_complete_checkpoint_is_chosen_and_the_incomplete_ones_are_named(tmp_path, caplog):
    out = str(tmp_path)
    assert find_resumable_checkpoint(os.path.join(out, "absent")) is None
    four = _checkpoint(os.path.join(out, "checkpoint-4"), world_size=2)
    _checkpoint(os.path.join(out, "checkpoint-8"), world_size=2, marked=False)  # the job died while writing it
    twelve = _checkpoint(os.path.join(out, "checkpoint-12"), world_size=2)
    with open(os.path.join(twelve, "model.safetensors"), "ab") as f:  # changed after it was marked complete
        f.write(b"y")
    _checkpoint(os.path.join(out, "checkpoint-16"), world_size=2)
    os.unlink(os.path.join(out, "checkpoint-16", SUBDIR, "rank_00001-of-00002.pt"))
    os.makedirs(os.path.join(out, "checkpoint-20-tmp"))  # not a checkpoint folder name
    with caplog.at_level(logging.INFO, logger="birder_hf.elastic"):
        assert find_resumable_checkpoint(out) == four
    text = caplog.text
    assert f"Resuming from {four}, the newest checkpoint complete on every rank" in text
    assert "checkpoint-8 (no birder_complete.json" in text
    assert "checkpoint-12 (model.safetensors has 101 bytes, 100 when it was marked complete)" in text
    assert "checkpoint-16 (birder/rank_00001-of-00002.pt is missing)" in text
    assert checkpoint_problem(four) is None
    for name in ("checkpoint-8", "checkpoint-12", "checkpoint-16"):  # left as they were
        assert os.path.isdir(os.path.join(out, name))
    with open(os.path.join(four, MARKER), "w") as f:
        f.write("{")  # a marker cut short cannot happen (atomic rename), a damaged one is refused all the same
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="birder_hf.elastic"):
        assert find_resumable_checkpoint(out) is None
    assert f"No complete checkpoint in {out}: starting fresh." in caplog.text
    assert "checkpoint-4 (its birder_complete.json is unreadable" in caplog.text


def test_a_checkpoint_without_every_rank_birder_file_is_not_marked(tmp_path):
    folder = _checkpoint(str(tmp_path / "checkpoint-3"), marked=False)
    with pytest.raises(RuntimeError, match="rank 1 has no .*rank_00001-of-00002.pt"):
        mark_checkpoint_complete(folder, rank=1, world_size=2)
    assert not os.path.exists(os.path.join(folder, MARKER))
    marker = mark_checkpoint_complete(folder, rank=0, world_size=1)
    files = json.load(open(marker))["files"]
    assert files == {"birder/rank_00000-of-00001.pt": files["birder/rank_00000-of-00001.pt"], "model.safetensors": 100}


def test_a_rank_file_rewritten_in_place_at_the_same_size_is_caught_by_its_checksum(tmp_path, caplog):
    out = str(tmp_path)
    older = _checkpoint(os.path.join(out, "checkpoint-4"))
    newer = _checkpoint(os.path.join(out, "checkpoint-8"))
    marker = json.load(open(os.path.join(newer, MARKER)))
    rel = "birder/rank_00000-of-00001.pt"
    assert marker["sha256"] == {name: file_sha256(os.path.join(newer, name)) for name in marker["files"]}
    path = os.path.join(newer, *rel.split("/"))
    size = os.path.getsize(path)
    other = Birder([torch.nn.Parameter(torch.ones(3))], lr=0.2)  # another state of the same layout
    os.rename(save_rank_state(other, str(tmp_path / "elsewhere"), rank=0, world_size=1), path)
    assert os.path.getsize(path) == size  # sizes alone saw nothing
    with caplog.at_level(logging.INFO, logger="birder_hf.elastic"):
        assert find_resumable_checkpoint(out) == older
    assert f"checkpoint-8 ({rel} was changed after it was marked complete" in caplog.text
    with pytest.raises(RuntimeError, match="was changed after it was marked complete.*resume from another checkpoint"):
        load_rank_state(Birder([torch.nn.Parameter(torch.ones(3))], lr=0.1), newer, rank=0, world_size=1)
    load_rank_state(Birder([torch.nn.Parameter(torch.ones(3))], lr=0.1), older, rank=0, world_size=1)


_HOLD = """
import os, sys, time
sys.path.insert(0, {src!r})
from birder_hf.elastic import claim_output_dir
claim_output_dir({folder!r})
if {release!r} and os.fork() == 0:  # a data loader worker: it keeps the lock after its parent died, until released
    while not os.path.exists({release!r}):
        time.sleep(0.05)
    os._exit(0)
print("held", flush=True)
{then}
"""


def _holder(folder, *, release=None, then="sys.stdin.read()"):
    """A process that holds ``folder``'s lock; with ``release`` (a path), a child it forked keeps holding it after the
    process ends, until that path exists."""
    script = _HOLD.format(src=ROOT + "/src", folder=folder, release=str(release or ""), then=then)
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_an_output_dir_another_job_writes_is_refused_until_that_job_ends(tmp_path):
    from birder_hf.elastic import LOCK, claim_output_dir

    out = str(tmp_path / "out")
    other = _holder(out)
    try:
        with pytest.raises(RuntimeError, match=f"{re.escape(out)} is being written by another job .*pid {other.pid}.*"
                           "give this job its own output folder, or wait for that job to end"):  # fmt: skip
            claim_output_dir(out)
    finally:
        other.kill()  # SIGKILL: no clean-up ran, the operating system released the lock
        other.wait()
    claim_output_dir(out)
    claim_output_dir(out)  # held by this process already: free
    assert json.load(open(os.path.join(out, LOCK)))["pid"] == os.getpid()
    # a holder that died here while a child it forked still holds the lock (an elastic restart): waited for
    # (the claim must not return before the orphan is released: a timer releases it a second into the claim, so a
    # claim that did not wait returns before the release file exists, however loaded the machine)
    orphaned, release = str(tmp_path / "orphaned"), tmp_path / "release"
    _holder(orphaned, release=release, then="").wait()
    timer = threading.Timer(1.0, release.touch)
    timer.start()
    try:
        claim_output_dir(orphaned)
        assert release.exists(), "the claim returned while the orphaned child still held the lock"
    finally:
        timer.cancel()
        release.touch()  # frees the child whatever happened
    # a folder that cannot be written is refused before training, not at the first checkpoint
    with open(tmp_path / "file", "w"):
        pass
    with pytest.raises(RuntimeError, match="file/out is not writable .*choose a writable output folder"):
        claim_output_dir(str(tmp_path / "file" / "out"))


def test_a_trainer_whose_output_dir_another_job_writes_stops_before_training(tmp_path):
    from transformers import TrainingArguments

    from birder_hf.integrations.transformers import BirderTrainer

    out = str(tmp_path / "out")
    other = _holder(out)
    try:
        args = TrainingArguments(output_dir=out, use_cpu=True, max_steps=2, save_steps=1, report_to=[])
        data = [{"x": torch.ones(4), "labels": torch.zeros(3)}] * 4
        trainer = BirderTrainer(model=torch.nn.Linear(4, 3), args=args, train_dataset=data)
        with pytest.raises(RuntimeError, match="is being written by another job"):
            trainer.train()
        assert trainer.state.global_step == 0 and sorted(os.listdir(out)) == ["_birder.lock"]
    finally:
        other.kill()
        other.wait()


def test_a_restart_on_the_store_of_the_last_attempt_is_refused_with_the_fix(monkeypatch):
    from birder_hf.integrations.accelerate import check_elastic_restart

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    check_elastic_restart()  # the first attempt: nothing stale yet
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(RuntimeError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_elastic_restart()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    check_elastic_restart()


def _elastic(nproc, script, args, kills, events, *, max_restarts=2, launcher=("--standalone",), agent="", **env):
    env = {
        **os.environ,
        "BIRDER_TEST_AGENT": agent,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": ROOT + "/src",
        "BIRDER_TEST_KILL": json.dumps(kills),
        "BIRDER_TEST_EVENTS": events,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # a new store per attempt (check_elastic_restart)
        **env,
    }
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher,
        "--nproc_per_node",
        str(nproc),
        "--max_restarts",
        str(max_restarts),
        "tests/_elastic_script.py",
        script,
        *args,
    ]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=900):
    log, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, log[-6000:]
    return log


def _events(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _same_bits(a, b, world_size, step, weights=""):
    """Weights (``a/weights/model.safetensors``) and every rank's Birder state of checkpoint-``step``: equal bits."""
    wa, wb = (load_file(os.path.join(x, weights, "model.safetensors")) for x in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    for rank in range(world_size):
        name = f"rank_{rank:05d}-of-{world_size:05d}.pt"
        sa, sb = (
            torch.load(os.path.join(x, f"checkpoint-{step}", SUBDIR, name), weights_only=True)["optimizer"]["state"]
            for x in (a, b)
        )
        assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_bert_recipe_restarts_by_itself_after_sigkills_and_ends_bitwise_like_one_resume(tmp_path):
    """torchrun --max_restarts 2: rank 1 is SIGKILLed at step 6 (after checkpoint-4); the restart resumes from
    checkpoint-4; rank 0 is SIGKILLed while writing checkpoint-8; the second restart resumes from checkpoint-4 again
    (checkpoint-8 is incomplete) and finishes. The weights and every rank's m, b equal an uninterrupted run's that
    resumed from the same checkpoint-4, bit for bit."""
    a, b, events = str(tmp_path / "elastic"), str(tmp_path / "reference"), str(tmp_path / "events.jsonl")
    common = [*BERT_TINY, "--max_steps", "12", "--save_steps", "4"]
    kills = [
        {"at": "step", "step": 6, "ranks": [1]},
        {"at": "save", "step": 8, "ranks": [0]},
    ]
    argv = [*common, "--output_dir", a, "--resume_from_checkpoint", "auto"]
    log = _finish(_elastic(2, "recipes/bert_base.py", argv, kills, events))
    assert f"No complete checkpoint in {a}: starting fresh." in log
    assert log.count(f"Resuming from {a}/checkpoint-4, the newest checkpoint complete on every rank") == 2
    assert f"Not resuming from {a}/checkpoint-8 (no birder_complete.json" in log
    seen = _events(events)
    assert [(e["restart"], e["rank"], e["step"]) for e in seen if e["event"] == "kill"] == [(0, 1, 6), (1, 0, 8)]
    assert sorted((e["restart"], e["step"]) for e in seen if e["event"] == "first_step") == [
        (0, 0),
        (0, 0),
        (1, 4),
        (1, 4),
        (2, 4),
        (2, 4),
    ]
    for step in (4, 8, 12):
        assert checkpoint_problem(os.path.join(a, f"checkpoint-{step}")) is None
    shutil.copytree(os.path.join(a, "checkpoint-4"), os.path.join(b, "checkpoint-4"))
    _torchrun(2, "recipes/bert_base.py", *common, "--output_dir", b, "--resume_from_checkpoint", f"{b}/checkpoint-4")
    _same_bits(a, b, 2, 12)


@pytest.mark.slow
def test_a_restart_without_a_new_store_stops_with_the_fix(tmp_path):
    """What check_elastic_restart guards against, for real: torchrun's default shared store, a SIGKILL, a restart."""
    events = str(tmp_path / "events.jsonl")
    argv = [*BERT_TINY, "--max_steps", "4", "--output_dir", str(tmp_path), "--resume_from_checkpoint", "auto"]
    kills = [{"at": "step", "step": 1, "ranks": [1]}]
    shared = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}  # torchrun's default
    proc = _elastic(2, "recipes/bert_base.py", argv, kills, events, max_restarts=1, **shared)
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode != 0 and "Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in log, log[-3000:]


@pytest.mark.slow
def test_causal_lm_recipe_restarts_by_itself_after_a_sigkill(tmp_path):
    a, b, events = str(tmp_path / "elastic"), str(tmp_path / "reference"), str(tmp_path / "events.jsonl")
    common = [*LM_TINY, "--cache_dir", str(tmp_path / "data"), "--max_steps", "9"]
    common += ["--save_strategy", "steps", "--save_steps", "3"]
    kills = [{"at": "step", "step": 5, "ranks": [1]}, {"at": "save", "step": 6, "ranks": [1]}]
    argv = [*common, "--output_dir", a, "--resume_from_checkpoint", "auto"]
    log = _finish(_elastic(2, "recipes/causal_lm.py", argv, kills, events))
    assert log.count(f"Resuming from {a}/checkpoint-3, the newest checkpoint complete on every rank") == 2
    assert f"Not resuming from {a}/checkpoint-6 (no birder_complete.json" in log
    shutil.copytree(os.path.join(a, "checkpoint-3"), os.path.join(b, "checkpoint-3"))
    _torchrun(2, "recipes/causal_lm.py", *common, "--output_dir", b, "--resume_from_checkpoint", f"{b}/checkpoint-3")
    _same_bits(a, b, 2, 9)


@pytest.mark.slow
def test_bert_recipe_survives_a_lost_node_then_shrinks_to_the_node_left(tmp_path):
    """Two torchrun agents ("nodes" a and b, one rank each) with ``--nnodes 1:2``. Every rank of node b is SIGKILLed
    at step 6: both agents restart their workers, which resume from checkpoint-4 on 2 nodes. At step 10 node b is lost
    for good (its agent SIGKILLed too): node a restarts alone and resumes from checkpoint-8 with world size 1, its rank
    0 taking saved rank 0's m and b (rank r takes saved rank r mod the old world size, with a warning).

    Checks: checkpoint-8 equals that of an uninterrupted 2-rank run resumed from checkpoint-4, and the final weights
    and m, b equal those of an uninterrupted 1-rank run resumed from checkpoint-8, bit for bit."""
    a, events = str(tmp_path / "elastic"), str(tmp_path / "events.jsonl")
    common = [*BERT_TINY, "--max_steps", "12", "--save_steps", "4"]
    kills = [
        {"at": "step", "step": 6, "from": 0, "agents": ["b"]},
        {"at": "step", "step": 10, "from": 4, "agents": ["b"], "agent": True},
    ]
    rdzv = f"127.0.0.1:{_free_port()}"
    launcher = ["--nnodes", "1:2", "--rdzv_backend", "c10d", "--rdzv_endpoint", rdzv, "--rdzv_id", "birder-elastic"]
    argv = [*common, "--output_dir", a, "--resume_from_checkpoint", "auto"]
    node_a = _elastic(1, "recipes/bert_base.py", argv, kills, events, launcher=launcher, max_restarts=3, agent="a")
    time.sleep(3)  # node a hosts the rendezvous store, and outlives node b
    node_b = _elastic(1, "recipes/bert_base.py", argv, kills, events, launcher=launcher, max_restarts=3, agent="b")
    log = _finish(node_a, timeout=1500)
    log_b, _ = node_b.communicate(timeout=60)
    assert node_b.returncode == -9, log_b[-3000:]  # SIGKILLed
    log += log_b
    seen = _events(events)
    assert [(e["agent"], e["step"]) for e in seen if e["event"] == "kill"] == [("b", 6), ("b", 10)]
    attempts = sorted((e["step"], e["agent"]) for e in seen if e["event"] == "first_step")
    assert attempts == [(0, "a"), (0, "b"), (4, "a"), (4, "b"), (8, "a")], attempts
    assert f"Resuming from {a}/checkpoint-8, the newest checkpoint complete on every rank" in log
    note = "Resuming Birder with world size 1 from a checkpoint of world size 2: rank 0 takes the optimizer state of "
    assert note + "saved rank 0" in log
    # the same outcome as one resume: 2 ranks from checkpoint-4 to checkpoint-8, then 1 rank from checkpoint-8
    two, one = str(tmp_path / "two_ranks"), str(tmp_path / "one_rank")
    shutil.copytree(os.path.join(a, "checkpoint-4"), os.path.join(two, "checkpoint-4"))
    resume = ["--resume_from_checkpoint", f"{two}/checkpoint-4"]
    _torchrun(2, "recipes/bert_base.py", *common, "--num_nodes", "2", "--output_dir", two, *resume)
    _same_bits(a, two, 2, 8, weights="checkpoint-8")
    shutil.copytree(os.path.join(a, "checkpoint-8"), os.path.join(one, "checkpoint-8"))
    resume = ["--resume_from_checkpoint", f"{one}/checkpoint-8"]
    _torchrun(1, "recipes/bert_base.py", *common, "--output_dir", one, *resume)
    _same_bits(a, one, 1, 12)


def test_old_checkpoints_are_rotated_away_only_after_the_new_one_is_marked_complete(tmp_path, monkeypatch):
    """save_total_limit=1: the Trainer rotates right after writing trainer_state.json; BirderTrainer waits for the
    marker, so a job that dies before it (here: the marker's write fails at step 3) keeps checkpoint-2."""
    from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

    import birder_hf.integrations.transformers as integration
    from birder_hf.integrations.transformers import BirderTrainer

    real = integration.mark_checkpoint_complete

    def dies_at_step_3(folder, **kwargs):
        if folder.endswith("checkpoint-3"):
            raise KeyboardInterrupt("the job stops before the marker")  # not an Exception: nothing catches it
        return real(folder, **kwargs)

    monkeypatch.setattr(integration, "mark_checkpoint_complete", dies_at_step_3)
    config = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=2
    )
    ids = torch.randint(0, 50, (32, 6), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids[i], "labels": int(ids[i, 0] % 2)} for i in range(32)]
    out = str(tmp_path)
    args = TrainingArguments(
        output_dir=out, use_cpu=True, max_steps=4, save_steps=1, save_total_limit=1, report_to=[], disable_tqdm=True
    )
    trainer = BirderTrainer(model=BertForSequenceClassification(config), args=args, train_dataset=data)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert sorted(os.listdir(out)) == ["_birder.lock", "checkpoint-2", "checkpoint-3"]  # checkpoint-1 rotated away
    assert checkpoint_problem(os.path.join(out, "checkpoint-2")) is None
    assert find_resumable_checkpoint(out) == os.path.join(out, "checkpoint-2")


def test_checkpoint_names_are_read_strictly(tmp_path):
    # issue 41: "\d+" read checkpoint-0012 and checkpoint-١٢ (Arabic-Indic digits) as step 12, newer than checkpoint-5;
    # the Trainer writes ASCII digits without a leading zero, and only such names are its checkpoints now
    out = str(tmp_path)
    five = _checkpoint(os.path.join(out, "checkpoint-5"))
    for name in ("checkpoint-0012", "checkpoint-\u0661\u0662", "checkpoint-+12", "checkpoint-12 "):
        _checkpoint(os.path.join(out, name))
    assert find_resumable_checkpoint(out) == five


def test_a_file_or_a_checkpoint_given_as_the_search_folder_is_refused(tmp_path):
    # issue 41: both meant a fresh start with one INFO line, and an elastic restart silently trained from step 0
    from birder_hf.integrations.lightning import find_resumable_lightning_checkpoint

    out = str(tmp_path)
    four = _checkpoint(os.path.join(out, "checkpoint-4"))
    says = re.escape(f"{four} is a checkpoint") + ".*" + re.escape(f"its parent ({out})")
    with pytest.raises(ValueError, match=says):
        find_resumable_checkpoint(four)
    a_file = os.path.join(out, "epoch=0-step=4.ckpt")
    open(a_file, "wb").close()
    for find in (find_resumable_checkpoint, find_resumable_lightning_checkpoint):
        with pytest.raises(ValueError, match="is a file, not the folder that holds the checkpoints"):
            find(a_file)
    assert find_resumable_checkpoint(out) == four


def _mark_with_a_directory_in_the_markers_place(rank, world, folder):
    opt = Birder([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    save_rank_state(opt, folder, rank=rank, world_size=world)
    if rank == 0:
        os.makedirs(os.path.join(folder, MARKER))
    try:
        mark_checkpoint_complete(folder, rank=rank, world_size=world)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_a_marker_path_that_is_a_directory_stops_every_rank(tmp_path):
    # issue 41: rank 0 failed writing the marker after the ranks had agreed, and rank 1 went on to wait for it
    from _dist import run_distributed

    for message in run_distributed(_mark_with_a_directory_in_the_markers_place, 2, str(tmp_path), timeout=60):
        assert message is not None and "cannot write" in message and "a directory is in its place" in message
