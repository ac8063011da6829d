"""accelerate after an elastic restart: ``save_state`` marks a checkpoint complete only once every rank wrote its
files, and ``load_resumable_state`` resumes from the newest complete one, bit for bit (2 real ranks on gloo).

Three 2-rank runs of 8 steps share one ``ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)``:
``straight`` saves after steps 2, 4 and 6 (``checkpoints/checkpoint_0..2``); the test then breaks ``checkpoint_2`` as a
save killed midway would leave it (rank 1's Birder file and the marker gone); ``manual`` resumes with
``accelerator.load_state(checkpoint_1)``, ``auto`` with ``load_resumable_state(accelerator)``. About 10 s in all on an
idle 2-core machine.
"""

import json
import logging
import os

import pytest
import torch
from _dist import run_distributed
from test_integrations import Regression, TinyRegressor, _launcher_env, _opt_state, _same_state

from birder_hf import Birder
from birder_hf.checkpoint import MARKER, rank_state_path
from birder_hf.elastic import checkpoint_problem

pytest.importorskip("accelerate")

STEPS, SAVES = 8, (2, 4, 6)


def _logged(name: str) -> list:
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger(name).addHandler(handler)
    logging.getLogger(name).setLevel(logging.INFO)
    return records


def _run(rank, world, project, mode):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from birder_hf.integrations.accelerate import load_resumable_state, register_birder_hook

    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(cpu=True, project_config=config)
    model = TinyRegressor()
    opt = Birder(model.parameters(), lr=0.01, beta=0.9, weight_decay=0.1, seed=3)
    loader = torch.utils.data.DataLoader(Regression(), batch_size=8, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    if mode.startswith("load_first"):  # the load before the hook: each rank would get rank 0's m and b
        try:
            if mode == "load_first":
                acc.load_state(os.path.join(project, "checkpoints", "checkpoint_1"))
            else:
                load_resumable_state(acc)
            register_birder_hook(acc, model, opt)
        except RuntimeError as exc:
            return {"error": str(exc), "own_state": bool(opt.optimizer.state)}
        return {"error": None}
    register_birder_hook(acc, model, opt)
    if mode == "held":  # another job writes this project's checkpoints
        errors = []
        for call in (lambda: load_resumable_state(acc), acc.save_state):
            try:
                call()
            except RuntimeError as exc:
                errors.append(str(exc))
        return {"errors": errors, "saved": os.path.exists(os.path.join(project, "checkpoints"))}
    batches = list(loader)
    records = _logged("birder_hf.elastic")
    start, chosen = 0, None
    if mode == "manual":
        acc.load_state(os.path.join(project, "checkpoints", "checkpoint_1"))
        start = 4
    elif mode == "auto":
        chosen = load_resumable_state(acc)
        start = 4
    for step in range(start, STEPS):
        acc.backward(model(**batches[step % len(batches)])["loss"])
        opt.step()
        opt.zero_grad()
        if mode == "straight" and step + 1 in SAVES:
            acc.save_state()
    if mode == "auto":  # the next save goes after the incomplete checkpoint_2, which stays
        acc.save_state()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": _opt_state(opt.optimizer),
        "chosen": chosen,
        "log": [(r.levelname, r.getMessage()) for r in records],
    }


def test_save_state_marks_complete_and_auto_resume_continues_bit_for_bit(tmp_path):
    project = str(tmp_path / "project")
    kw = dict(timeout=240, local_world_size=2)
    straight = run_distributed(lambda r, w: _run(r, w, project, "straight"), 2, env=_launcher_env(), **kw)
    ckpts = os.path.join(project, "checkpoints")
    # total_limit=2: checkpoint_0 was removed once checkpoint_2 was marked complete
    assert sorted(os.listdir(ckpts)) == ["checkpoint_1", "checkpoint_2"]
    with open(os.path.join(ckpts, "checkpoint_1", MARKER)) as f:
        marker = json.load(f)
    # written after every rank's files: both Birder states and both RNG files, beside rank 0's weights and optimizer
    assert marker["world_size"] == 2 and sorted(marker["files"]) == [
        "birder/rank_00000-of-00002.pt",
        "birder/rank_00001-of-00002.pt",
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    assert checkpoint_problem(os.path.join(ckpts, "checkpoint_2")) is None
    broken = os.path.join(ckpts, "checkpoint_2")  # as a save killed midway leaves it
    os.unlink(os.path.join(broken, MARKER))
    os.unlink(rank_state_path(broken, 1, 2))

    manual = run_distributed(lambda r, w: _run(r, w, project, "manual"), 2, env=_launcher_env(), **kw)
    auto = run_distributed(lambda r, w: _run(r, w, project, "auto"), 2, env=_launcher_env(), **kw)
    for s, m, a in zip(straight, manual, auto):
        assert a["chosen"] == os.path.join(ckpts, "checkpoint_1")
        assert all(torch.equal(x, y) for x, y in zip(a["params"], m["params"]))
        assert all(torch.equal(x, y) for x, y in zip(a["params"], s["params"]))  # as if never interrupted
        assert _same_state(a["state"], m["state"]) and _same_state(a["state"], s["state"])  # this rank's m, b
    log = auto[0]["log"]
    assert (
        "WARNING",
        f"Not resuming from {broken} (no {MARKER}: the job stopped while writing it, or it predates "
        "completion markers); it is left as it is.",
    ) in log
    assert ("INFO", f"Resuming from {ckpts}/checkpoint_1, the newest checkpoint complete on every rank.") in log
    # the save after the resume became checkpoint_3 (accelerate would have tried checkpoint_0 again); the incomplete
    # checkpoint_2 was left alone, checkpoint_1 rotated away once checkpoint_3 was complete
    assert sorted(os.listdir(ckpts)) == ["checkpoint_2", "checkpoint_3"]
    assert checkpoint_problem(os.path.join(ckpts, "checkpoint_3")) is None
    assert checkpoint_problem(broken) is not None


class _FailsOnRank1AtTheSecondSave:
    """A user object saved with every checkpoint (``register_for_checkpointing``) that rank 1 cannot save the second
    time: that rank's part of the save fails after its Birder file was written."""

    def __init__(self, rank):
        self.rank, self.saves = rank, 0

    def state_dict(self):
        self.saves += 1
        if self.rank == 1 and self.saves == 2:
            raise RuntimeError("this rank could not serialize its state (test)")
        return {"saves": self.saves}

    def load_state_dict(self, state):
        self.saves = state["saves"]


def _fails(rank, world, project, other):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from birder_hf.integrations.accelerate import load_resumable_state, register_birder_hook

    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True, total_limit=1)
    acc = Accelerator(cpu=True, project_config=config)
    model = TinyRegressor()
    model, opt = acc.prepare(model, Birder(model.parameters(), lr=0.01, seed=3))
    register_birder_hook(acc, model, opt)
    acc.register_for_checkpointing(_FailsOnRank1AtTheSecondSave(rank))
    records = _logged("birder_hf.elastic")
    result = {}
    acc.save_state()  # checkpoint_0
    try:
        acc.save_state()  # checkpoint_1: rank 1 fails
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["listing"] = sorted(os.listdir(os.path.join(project, "checkpoints")))
    result["chosen"] = load_resumable_state(acc)
    result["iteration"] = acc.save_iteration
    acc.project_configuration.iteration = 0
    try:
        acc.save_state()  # accelerate refuses the existing checkpoint_0 (and its marker stays)
    except ValueError as exc:
        result["exists"] = str(exc)
    result["kept"] = checkpoint_problem(os.path.join(project, "checkpoints", "checkpoint_0"))
    result["other"] = load_resumable_state(acc, other)
    result["absent"] = load_resumable_state(acc, os.path.join(other, "absent"))
    acc.project_configuration.automatic_checkpoint_naming = False
    try:
        load_resumable_state(acc)
    except ValueError as exc:
        result["no_folder"] = str(exc)
    result["log"] = [(r.levelname, r.getMessage()) for r in records]
    return result


def test_a_rank_that_fails_to_save_fails_every_rank_without_a_marker_and_nothing_complete_starts_fresh(tmp_path):
    project, other = str(tmp_path / "project"), str(tmp_path / "other")
    os.makedirs(os.path.join(other, "step_1"))  # a checkpoint folder without a marker
    results = run_distributed(
        lambda r, w: _fails(r, w, project, other), 2, timeout=240, local_world_size=2, env=_launcher_env()
    )
    r0, r1 = results
    ckpts = os.path.join(project, "checkpoints")
    broken = os.path.join(ckpts, "checkpoint_1")
    assert r0["error"] == (
        f"RuntimeError: Checkpoint {broken} was not marked complete: rank 1 failed to write its files (RuntimeError: "
        "this rank could not serialize its state (test)). Every rank saves its Birder state (save_rank_state) before "
        "mark_checkpoint_complete; a resume will not choose this checkpoint."
    )
    assert r1["error"] == "RuntimeError: this rank could not serialize its state (test)"  # its own, at once
    assert not os.path.exists(os.path.join(broken, MARKER))
    assert os.path.isfile(os.path.join(broken, "model.safetensors"))  # rank 0 wrote its files
    for r in results:
        # total_limit=1 removes checkpoint_0 only once a newer checkpoint is complete (accelerate alone removes it
        # before writing the next one: nothing to resume from after this failure)
        assert r["listing"] == ["checkpoint_0", "checkpoint_1"]
        assert r["chosen"] == os.path.join(ckpts, "checkpoint_0") and r["iteration"] == 2
        assert "already exists" in r["exists"] and r["kept"] is None
        assert r["other"] is None and r["absent"] is None
        assert "pass checkpoints_dir=" in r["no_folder"]
    log = r0["log"]
    step_1 = os.path.join(other, "step_1")
    assert log == [
        (
            "WARNING",
            f"Not resuming from {broken} (no {MARKER}: the job stopped while writing it, or it predates "
            "completion markers); it is left as it is.",
        ),
        ("INFO", f"Resuming from {ckpts}/checkpoint_0, the newest checkpoint complete on every rank."),
        (
            "WARNING",
            f"Not resuming from {step_1} (no {MARKER}: the job stopped while writing it, or it predates "
            "completion markers); it is left as it is.",
        ),
        ("INFO", f"No complete checkpoint in {other}: starting fresh."),
        ("INFO", f"No complete checkpoint in {other}/absent: starting fresh."),
    ]
    assert r1["log"] == []  # rank 0 looks, every rank gets its answer


def test_a_load_before_the_hook_is_registered_is_refused(tmp_path):
    # accelerate's load_state (and load_resumable_state) before register_birder_hook loaded rank 0's optimizer state
    # into every rank, and training went on silently with one rank's m and b everywhere
    project = str(tmp_path / "project")
    run_distributed(_run, 2, project, "straight", env=_launcher_env(), timeout=300, local_world_size=2)
    for mode in ("load_first", "load_first_auto"):
        for out in run_distributed(_run, 2, project, mode, env=_launcher_env(), timeout=300, local_world_size=2):
            assert out["error"] is not None and "each rank holds the same m and b" in out["error"], mode
            assert "register_birder_hook right after prepare" in out["error"] and out["own_state"]


def test_a_project_another_job_writes_stops_every_rank_before_it_loads_or_saves(tmp_path):
    from test_elastic import _holder

    project = str(tmp_path / "project")
    other = _holder(project)
    try:
        outs = run_distributed(_run, 2, project, "held", env=_launcher_env(), timeout=300, local_world_size=2)
    finally:
        other.kill()
        other.wait()
    for out in outs:  # rank 0 holds the lock; both ranks raise its refusal, at the load and at the save
        assert len(out["errors"]) == 2 and not out["saved"], out
        assert all(f"rank 0: {project} is being written by another job" in e for e in out["errors"]), out


def test_resume_discovery_reads_checkpoint_names_strictly(tmp_path):
    # issue 41: a name merely ending in digits was a checkpoint (logs20240101 became the next save number
    # checkpoint_20240102), and step_100 of one naming scheme was loaded over a newer checkpoint_1 of another
    from accelerate import Accelerator

    from birder_hf.integrations.accelerate import load_resumable_state

    for name in ("logs20240101", "step_0100", "checkpoint_1"):
        os.makedirs(tmp_path / name)
    acc = Accelerator(cpu=True)
    assert load_resumable_state(acc, tmp_path) is None  # checkpoint_1 has no marker; the others are not checkpoints
    os.makedirs(tmp_path / "step_100")
    with pytest.raises(ValueError, match="named in 2 ways .checkpoint_1, step_100.*keep one naming scheme"):
        load_resumable_state(acc, tmp_path)
