"""BirderDDPStrategy: real Lightning Trainers on 2 CPU processes (gloo), plus in-process checks of the refusals and
the checkpoint seams.

One launch of ``tests/_lightning_script.py`` runs every multi-process fit (Lightning re-launches a script once; later
Trainers reuse the processes): about 12 s on an idle 2-core machine.
"""

import csv
import glob
import json
import logging
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")

from birder_hf import Birder, OneBitAdam  # noqa: E402
from birder_hf.checkpoint import MARKER
from birder_hf.elastic import checkpoint_problem  # noqa: E402
from birder_hf.integrations import lightning as birder_lightning  # noqa: E402
from birder_hf.integrations.lightning import (  # noqa: E402
    BirderDDPStrategy,
    birder_state_dir,
    find_resumable_lightning_checkpoint,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_lightning_script.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lightning")
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.path.join(ROOT, "src"),
    }
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):  # else Lightning would not launch
        env.pop(name, None)
    res = subprocess.run(
        [sys.executable, SCRIPT, str(out)], env=env, cwd=out, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return out, res.stdout + res.stderr


def _load(out, tag, rank):
    return torch.load(os.path.join(out, f"{tag}-rank{rank}.pt"), weights_only=True)


def _states_equal(a: dict, b: dict) -> bool:
    sa, sb = a["state"], b["state"]
    return sa.keys() == sb.keys() and all(
        sa[i].keys() == sb[i].keys() and all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]) for i in sa
    )


def test_resume_continues_bit_for_bit_on_every_rank(run):
    out, _ = run
    for rank in (0, 1):
        full, resumed = _load(out, "full", rank), _load(out, "resume", rank)
        assert full["global_step"] == resumed["global_step"] == 8  # 4 epochs x 2 steps (accumulate_grad_batches=2)
        assert all(torch.equal(a, b) for a, b in zip(full["params"], resumed["params"]))
        assert _states_equal(full["optimizer"], resumed["optimizer"])  # m, b, step of this rank


def test_replicas_agree_and_birder_state_is_rank_local(run):
    out, log = run
    r0, r1 = _load(out, "full", 0), _load(out, "full", 1)
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    # each rank's m differs: resuming rank 1 from rank 0's state would change the run (the test above would fail)
    assert not torch.equal(r0["optimizer"]["state"][0]["exp_avg"], r1["optimizer"]["state"][0]["exp_avg"])
    assert r0["topology"] == "Topology(1 node x 2 ranks, rank 0)"
    assert "1-bit hierarchical hook registered" in log


def test_comm_stats_reach_the_logger(run):
    out, _ = run
    with open(os.path.join(out, "csv", "version_0", "metrics.csv"), newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("birder/bytes_sent")]
    assert len(rows) == 8  # one row per optimizer step (log_every_n_steps=1)
    sent = [float(r["birder/bytes_sent"]) for r in rows]
    assert sent == sorted(sent) and sent[0] > 0  # cumulative since the fit started
    assert float(rows[-1]["birder/bytes_sent"]) == _load(out, "full", 0)["bytes_sent"]
    # 161 parameters on 1 node x 2 (hierarchical on one node: the exact vote mean, as allgather): 21 bytes a step
    # instead of 644 for the fp32 ring all-reduce
    assert float(rows[-1]["birder/compression_ratio"]) == pytest.approx(644 / 21, rel=1e-6)
    assert float(rows[-1]["birder/skipped_steps"]) == 0


def test_every_rank_writes_its_state_beside_the_checkpoint_and_it_goes_with_it(run):
    out, _ = run
    ckpts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "ckpt", "*")))
    # save_top_k=1 removed epoch 0's checkpoint, and with it its Birder folder
    assert ckpts == ["_birder.lock", "epoch=1-step=4.ckpt", "epoch=1-step=4.ckpt.birder"]  # _birder.lock: the job's
    files = sorted(os.listdir(os.path.join(out, "ckpt", "epoch=1-step=4.ckpt.birder", "birder")))
    assert files == ["rank_00000-of-00002.pt", "rank_00001-of-00002.pt"]


def test_a_checkpoint_is_marked_complete_after_every_rank_wrote_it(run):
    out, _ = run
    folder = os.path.join(out, "ckpt", "epoch=1-step=4.ckpt.birder")
    with open(os.path.join(folder, MARKER)) as f:
        marker = json.load(f)
    assert marker["world_size"] == 2
    assert sorted(marker["files"]) == [
        "../epoch=1-step=4.ckpt",  # rank 0's, written after every rank's Birder file
        "birder/rank_00000-of-00002.pt",
        "birder/rank_00001-of-00002.pt",
    ]
    ckpt = os.path.join(out, "ckpt", "epoch=1-step=4.ckpt")
    assert marker["files"]["../epoch=1-step=4.ckpt"] == os.path.getsize(ckpt)
    assert checkpoint_problem(folder) is None


def _elastic(out, rank):
    with open(os.path.join(out, f"elastic-rank{rank}.json")) as f:
        return json.load(f)


def test_auto_resume_skips_a_checkpoint_killed_while_saving_and_continues_bit_for_bit(run):
    # the step-4 save was "killed" (epoch=1-step=4.ckpt and the rewritten last.ckpt lack rank 1's file and the marker):
    # find_resumable_lightning_checkpoint chooses epoch=0-step=2.ckpt, and the fit resumed from it ends where a fit
    # resumed from that path by hand ends, and where the uninterrupted 4 epochs end, bit for bit, m and b included
    out, log = run
    for rank in (0, 1):
        assert _elastic(out, rank)["chosen"] == os.path.join(out, "auto", "epoch=0-step=2.ckpt")
        auto, manual, full = _load(out, "auto", rank), _load(out, "manual", rank), _load(out, "full", rank)
        assert auto["global_step"] == manual["global_step"] == 8
        assert all(torch.equal(a, b) for a, b in zip(auto["params"], manual["params"]))
        assert all(torch.equal(a, b) for a, b in zip(auto["params"], full["params"]))
        assert _states_equal(auto["optimizer"], manual["optimizer"])
        assert _states_equal(auto["optimizer"], full["optimizer"])
    for name in ("last.ckpt", "epoch=1-step=4.ckpt"):  # named (rank 0 only), left alone
        path = os.path.join(out, "auto", name)
        assert log.count(f"Not resuming from {path} (no {MARKER}: ") == 1 and os.path.exists(path)
    chosen = os.path.join(out, "auto", "epoch=0-step=2.ckpt")
    assert log.count(f"Resuming from {chosen}, the newest checkpoint complete on every rank.") == 1


def test_ckpt_path_last_is_refused_on_every_rank_when_last_ckpt_is_incomplete(run):
    out, _ = run
    last = os.path.join(out, "auto", "last.ckpt")
    for rank in (0, 1):
        error = _elastic(out, rank)["last-refused"]
        assert error.startswith(f"RuntimeError: {last} is not complete on every rank (rank 0 sees: no {MARKER}")
        assert "ckpt_path=find_resumable_lightning_checkpoint(dirpath)" in error


def test_a_rank_that_fails_to_save_fails_every_rank_and_no_marker_is_written(run):
    out, _ = run
    folder = os.path.join(out, "blocked", "epoch=0-step=2.ckpt.birder")
    assert _elastic(out, 0)["save-fails"].startswith(
        f"RuntimeError: Checkpoint {folder} was not marked complete: rank 1 failed to write its files "
        "(IsADirectoryError"
    )
    assert _elastic(out, 1)["save-fails"].startswith("IsADirectoryError")  # its own error, not a wait for rank 0
    assert not os.path.exists(os.path.join(folder, MARKER))


def test_hierarchy_num_nodes_simulates_two_nodes(run):
    out, _ = run
    r0, r1 = _load(out, "nodes2x1", 0), _load(out, "nodes2x1", 1)
    assert r1["topology"] == "Topology(2 nodes x 1 rank, rank 1)"
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))


def test_onebitadam_trains_through_the_strategy(run):
    out, log = run
    r0, r1 = _load(out, "onebitadam", 0), _load(out, "onebitadam", 1)
    assert r0["global_step"] == 2 and r0["bytes_sent"] > 0
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))
    assert "OneBitAdam: 1-bit Adam hook registered" in log


def test_real_trainer_refuses_another_optimizer_on_every_rank(run):
    out, _ = run
    for rank in (0, 1):
        with open(os.path.join(out, f"refused-rank{rank}.json")) as f:
            error = json.load(f)["error"]
        assert error is not None and "return a birder_hf.Birder (or OneBitAdam), got AdamW" in error


def test_fp16_mixed_precision_trains_with_the_loss_scaled_gradients(run):
    # Lightning's fp16 AMP (MixedPrecision + GradScaler): the scaler must not un-scale .grad (it holds d after the
    # hook), and the strategy hands the hook the plugin's scaler, which divides the scale out of every gradient: a run
    # with the loss scaled by 2**12 ends exactly where the same fp16 run with scale 1 does, m and b included, on every
    # rank, with no step skipped and the scale never backed off
    out, _ = run
    for rank in (0, 1):
        scaled, plain = _load(out, "fp16", rank), _load(out, "fp16-scale1", rank)
        assert scaled["precision"] == "MixedPrecision 16-mixed" and scaled["scale"] == 2.0**12
        assert scaled["global_step"] == 4 and scaled["skipped_steps"] == 0
        assert all(torch.equal(a, b) for a, b in zip(scaled["params"], plain["params"]))
        m_scaled = scaled["optimizer"]["state"][0]["exp_avg"]
        # in the gradient's unit, not 2**12 times it (fp16 rounds the two runs' gradients apart in the last bits)
        assert torch.allclose(m_scaled, plain["optimizer"]["state"][0]["exp_avg"], rtol=1e-3)
    r0, r1 = _load(out, "fp16", 0), _load(out, "fp16", 1)
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"]))


# ------------------------------------------------------------------------------------------------- in process
def test_refusals_say_how_to_fix():
    hook = lambda state, bucket: None  # noqa: E731
    with pytest.raises(ValueError, match="drop ddp_comm_hook"):
        BirderDDPStrategy(ddp_comm_hook=hook)
    with pytest.raises(ValueError, match="drop ddp_comm_state"):
        BirderDDPStrategy(ddp_comm_state=object())
    with pytest.raises(ValueError, match="post-local SGD"):
        BirderDDPStrategy(model_averaging_period=4)
    with pytest.raises(ValueError, match="unknown method .ring.; valid methods"):
        BirderDDPStrategy(method="ring")
    with pytest.raises(ValueError, match="hierarchy_num_nodes"):
        BirderDDPStrategy(hierarchy_num_nodes=0)

    check = birder_lightning._check_trainer_settings
    with pytest.raises(ValueError, match=r"Remove gradient_clip_val.*Birder\(grad_clip=...\) clips the gradient"):
        check(1.0)
    check(None)
    check(0.0)
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="bf16-mixed"):  # 1-bit Adam's step depends on the loss scale
        birder_lightning._check_precision("16-mixed", OneBitAdam(params, freeze_step=2))
    birder_lightning._check_precision("16-mixed", Birder(params))
    birder_lightning._check_precision("16-true", OneBitAdam(params, freeze_step=2))  # no loss scaling

    params = [torch.nn.Parameter(torch.zeros(2))]
    pick = birder_lightning._one_bit_optimizer
    with pytest.raises(ValueError, match=r"returned 2 \(manual optimization\)"):
        pick([Birder(params), Birder(params)], False)
    with pytest.raises(ValueError, match="returned 0"):
        pick([], True)
    with pytest.raises(TypeError, match="got SGD"):
        pick([torch.optim.SGD(params, lr=0.1)], True)
    opt = OneBitAdam(params, freeze_step=2)
    assert pick([opt], False) is opt


def _one_process_strategy():
    # a stepped Birder and a BirderDDPStrategy holding it, for the checkpoint seams in one process
    model = torch.nn.Linear(3, 1)
    model(torch.randn(4, 3)).sum().backward()
    opt = Birder(model.parameters(), lr=0.1, seed=1)
    opt.step()
    strategy = BirderDDPStrategy(parallel_devices=[torch.device("cpu")])
    strategy.optimizers = [opt]
    return opt, strategy


def test_checkpoint_seams_in_one_process(tmp_path):
    opt, strategy = _one_process_strategy()
    weight = opt.param_groups[0]["params"][0]
    path = tmp_path / "epoch=0-step=1.ckpt"
    strategy.save_checkpoint({"optimizer_states": [opt.state_dict()]}, path)
    assert os.path.isfile(birder_state_dir(path) + "/birder/rank_00000-of-00001.pt")

    # a symlinked checkpoint (save_last="link") finds its target's folder
    link = tmp_path / "last.ckpt"
    link.symlink_to(path.name)
    assert birder_state_dir(link) == birder_state_dir(path)
    saved = {k: v.clone() for k, v in opt.state[weight].items()}
    opt.state[weight]["exp_avg"].zero_()
    strategy.load_optimizer_state_dict(strategy.load_checkpoint(link))
    assert torch.equal(opt.state[weight]["exp_avg"], saved["exp_avg"])

    strategy.save_checkpoint({"state_dict": {}}, tmp_path / "weights.ckpt")  # save_weights_only: no Birder state
    assert not os.path.exists(birder_state_dir(tmp_path / "weights.ckpt"))

    strategy.remove_checkpoint(link)  # removing the link keeps the target's state
    assert not link.is_symlink() and path.exists() and os.path.isdir(birder_state_dir(path))
    strategy.remove_checkpoint(path)
    assert not path.exists() and not os.path.exists(birder_state_dir(path))

    other = tmp_path / "plain.ckpt"
    torch.save({"optimizer_states": [opt.state_dict()]}, other)
    with pytest.raises(FileNotFoundError, match="not written by BirderDDPStrategy"):
        strategy.load_optimizer_state_dict(strategy.load_checkpoint(other))
    with pytest.raises(ValueError, match="remote URL"):
        birder_state_dir("s3://bucket/epoch=0.ckpt")


def test_find_resumable_lightning_checkpoint_in_one_process(tmp_path, caplog):
    opt, strategy = _one_process_strategy()
    older, newer, last = tmp_path / "epoch=0-step=1.ckpt", tmp_path / "epoch=1-step=2.ckpt", tmp_path / "last.ckpt"
    for t, path in enumerate((older, newer)):
        strategy.save_checkpoint({"optimizer_states": [opt.state_dict()]}, path)
        for part in (path, birder_state_dir(path), os.path.join(birder_state_dir(path), MARKER)):
            os.utime(part, ns=(10**18 + t * 10**9,) * 2)  # written in this order, whatever the clock's resolution
    last.symlink_to(newer.name)  # save_last="link", made after its target
    os.utime(last, ns=(10**18 + 2 * 10**9,) * 2, follow_symlinks=False)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with caplog.at_level(logging.INFO):
        assert find_resumable_lightning_checkpoint(tmp_path) == str(last)

        os.unlink(os.path.join(birder_state_dir(newer), MARKER))  # the newest save was killed
        with pytest.warns(UserWarning) as warned:
            assert find_resumable_lightning_checkpoint(tmp_path) == str(older)
        named = sorted(str(w.message).split(" (")[0] for w in warned)
        assert named == [f"Not resuming from {p}" for p in (newer, last)]  # both named, both left

        os.unlink(older)  # a .ckpt gone, its Birder folder left: not complete either
        caplog.clear()
        with pytest.warns(UserWarning) as warned:
            assert find_resumable_lightning_checkpoint(tmp_path) is None
        assert str(warned[-1].message).startswith(f"Not resuming from {older} (the .ckpt is missing")
        assert f"No complete checkpoint in {tmp_path}: starting fresh." in caplog.messages
        assert find_resumable_lightning_checkpoint(tmp_path / "absent") is None


def test_find_resumable_lightning_checkpoint_orders_by_the_recorded_step(tmp_path):
    # issue 41: the newest by file time was chosen, so after a cp -r or a touch a fit resumed from an older step; the
    # completion marker now records the checkpoint's global_step, and the highest step wins
    opt, strategy = _one_process_strategy()
    later, earlier = tmp_path / "epoch=1-step=4.ckpt", tmp_path / "epoch=0-step=2.ckpt"
    for step, path in ((4, later), (2, earlier)):
        strategy.save_checkpoint({"optimizer_states": [opt.state_dict()], "global_step": step}, path)
    for part in (earlier, birder_state_dir(earlier), os.path.join(birder_state_dir(earlier), MARKER)):
        os.utime(part, ns=(2 * 10**18,) * 2)  # touched (or copied) after the later step was saved
    assert find_resumable_lightning_checkpoint(tmp_path) == str(later)
