"""fp16 loss scaling (``torch.amp.GradScaler``) with the 1-bit hook, on real ranks: accelerate's
``AcceleratedOptimizer`` and the HF Trainer, each against the same run without loss scaling.

The hook reads the scale each backward used and encodes ``g / S`` (exact: S is a power of two), and the optimizer tells
the scaler not to un-scale ``.grad`` (which holds ``d``): a scaled run is bit for bit the unscaled one, ``m`` and ``b``
included, through back-offs and growths. An overflow on one rank makes the last bucket's ``d`` NaN on every rank: every
rank's scaler skips ``step()`` and halves the scale, accelerate, the Trainer and ``Birder.step_was_skipped`` see a
skipped step, and ``m``, ``b`` and the parameters stay as they were. Before the fix the update was ``lr * d / S`` and
the scale never backed off; before the second fix ``m`` and ``b`` mixed gradients of two scales after a scale change,
and ``Birder.step_was_skipped`` kept the previous step's value when the scaler skipped ``step()``.

accelerate builds a ``GradScaler`` for ``mixed_precision="fp16"`` only on accelerators, so these CPU tests give the
``Accelerator`` a ``GradScaler("cpu")`` (its ``scaler`` attribute, which ``prepare`` and ``backward`` use); the
control flow is the one a GPU run takes (CUDA: ``tests/test_gpu_amp.py``). The overflow is the first step, as with a
too-large initial scale: afterwards the scale stays constant, and the run without a scaler skips the same step.
"""

from pathlib import Path

import torch
import torch.distributed as dist
from _dist import run_distributed

from birder_hf import Birder

SCALE = 2.0**12


class Net(torch.nn.Module):
    """A small regressor whose loss overflows on rank 1's forward number ``overflow_at`` (``overflow=True``)."""

    def __init__(self, overflow: bool = False, overflow_at: int = 0):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.overflow, self.overflow_at, self.calls = overflow, overflow_at, 0

    def forward(self, x, labels=None):
        out = self.body(x).squeeze(-1)
        loss = None if labels is None else torch.nn.functional.mse_loss(out, labels)
        if loss is not None and self.training:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if self.overflow and self.calls == self.overflow_at and rank == 1:
                loss = loss * float("inf")
            self.calls += 1
        return {"loss": loss, "logits": out}


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=g)
    return x, x @ torch.linspace(-1, 1, 8)


def _state(opt):
    return [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


def _accelerate_run(rank, world, scaled, steps=6, overflow_at=0, growth_interval=10**6):
    from accelerate import Accelerator

    from birder_hf.integrations.accelerate import register_birder_hook

    acc = Accelerator(cpu=True)
    if scaled:
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=growth_interval)
    model = Net(overflow=True, overflow_at=overflow_at)
    opt = Birder(model.parameters(), lr=0.01, beta=0.9, weight_decay=0.1, seed=3)
    model, opt = acc.prepare(model, opt)
    state = register_birder_hook(acc, model, opt)
    skipped, birder_skipped, scales, before = [], [], [], None
    for t in range(steps):
        x, y = _batch(rank, t)
        acc.backward(model(x, y)["loss"])
        if t == overflow_at:
            before = [p.detach().clone() for p in model.parameters()]
            state_before = _state(opt)
        opt.step()
        skipped.append(opt.step_was_skipped)
        birder_skipped.append(opt.optimizer.step_was_skipped)
        scales.append(acc.scaler.get_scale() if scaled else None)
        if t == overflow_at:
            unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and all(
                all(torch.equal(st[k], old[k]) for k in st) for st, old in zip(_state(opt), state_before)
            )
        opt.zero_grad()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": _state(opt.optimizer),
        "accelerate_skipped": skipped,
        "birder_skipped": birder_skipped,
        "scales": scales,
        "skipped_steps": state.skipped_steps,
        "first_step_unchanged": unchanged,
        "scale": acc.scaler.get_scale() if scaled else None,
    }


def test_fp16_loss_scaling_through_accelerate_equals_the_unscaled_run():
    scaled = run_distributed(_accelerate_run, 2, True, timeout=240, local_world_size=2)
    plain = run_distributed(_accelerate_run, 2, False, timeout=240, local_world_size=2)
    for s, p in zip(scaled, plain):
        assert s["skipped_steps"] == p["skipped_steps"] == 1  # rank 1's overflow skipped the step on both ranks
        assert s["first_step_unchanged"] and p["first_step_unchanged"]  # params, m, b and step untouched
        assert s["accelerate_skipped"] == [True] + [False] * 5  # AcceleratedOptimizer.step_was_skipped
        assert s["scale"] == SCALE / 2  # backed off once, on every rank
        # after the overflow the scale is constant: Birder's u, d and the update are those of the unscaled run
        assert all(torch.equal(a, b) for a, b in zip(s["params"], p["params"]))
        _assert_same_state(s["state"], p["state"])
    assert all(torch.equal(a, b) for a, b in zip(scaled[0]["params"], scaled[1]["params"]))


def test_fp16_scale_changes_leave_the_run_equal_to_the_unscaled_one_and_every_skip_is_reported():
    # an overflow at step 2 (m and b are no longer 0) and growth every 2 clean steps: 4096 x2 (step 1), /2 (the
    # overflow), x2, x2; the hook divides each backward's scale out, so m, b and the parameters never see it
    args = dict(steps=8, overflow_at=2, growth_interval=2)
    scaled = run_distributed(_accelerate_run, 2, True, *args.values(), timeout=240, local_world_size=2)
    plain = run_distributed(_accelerate_run, 2, False, *args.values(), timeout=240, local_world_size=2)
    skips = [False, False, True, False, False, False, False, False]
    for s, p in zip(scaled, plain):
        assert s["skipped_steps"] == p["skipped_steps"] == 1
        assert s["first_step_unchanged"] and p["first_step_unchanged"]
        assert s["accelerate_skipped"] == skips  # AcceleratedOptimizer.step_was_skipped
        assert s["birder_skipped"] == p["birder_skipped"] == skips  # Birder's own, also when the scaler skipped step()
        assert s["scales"] == [SCALE, 2 * SCALE, SCALE, SCALE, 2 * SCALE, 2 * SCALE, 4 * SCALE, 4 * SCALE]
        assert all(torch.equal(a, b) for a, b in zip(s["params"], p["params"]))
        _assert_same_state(s["state"], p["state"])  # m and b in the gradient's unit
    assert all(torch.equal(a, b) for a, b in zip(scaled[0]["params"], scaled[1]["params"]))


def _assert_same_state(scaled, plain):
    # the hook divides the loss scale out (exact: a power of two): m and b are the unscaled run's, bit for bit
    for a, b in zip(scaled, plain):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _optimizer_side_run(rank, world, scaled, steps=8, overflow_at=2):
    # Birder(process_group=...): no DDP, each rank steps on its own gradient; the 1-bit all-reduce runs in step()
    import warnings

    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    if scaled:
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=2)
    model = Net(overflow=True, overflow_at=overflow_at)
    inner = Birder(model.parameters(), lr=0.01, beta=0.9, weight_decay=0.1, seed=3, process_group=dist.group.WORLD)
    opt = acc.prepare(inner)
    record = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "a rank had a non-finite gradient"
        for t in range(steps):
            x, y = _batch(rank, t)
            acc.backward(model(x, y)["loss"])
            opt.step()
            record.append((opt.step_was_skipped, inner.step_was_skipped, acc.scaler.get_scale() if scaled else None))
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], _state(inner), record


def test_fp16_with_the_optimizer_side_all_reduce_backs_off_every_rank_and_equals_the_unscaled_run():
    # Before the fix an overflow on rank 1 backed off rank 1's scaler only ([4096, 2048] from then on), accelerate's
    # step_was_skipped stayed False, and m, b mixed the gradients of two scales after a scale change.
    scaled = run_distributed(_optimizer_side_run, 2, True, timeout=240, local_world_size=2)
    plain = run_distributed(_optimizer_side_run, 2, False, timeout=240, local_world_size=2)
    skips = [False, False, True, False, False, False, False, False]
    for (params, state, record), (plain_params, plain_state, plain_record) in zip(scaled, plain):
        assert [r[0] for r in record] == skips  # AcceleratedOptimizer.step_was_skipped
        assert [r[1] for r in record] == [r[1] for r in plain_record] == skips  # Birder's
        assert [r[2] for r in record] == [SCALE, 2 * SCALE, SCALE, SCALE, 2 * SCALE, 2 * SCALE, 4 * SCALE, 4 * SCALE]
        assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
        _assert_same_state(state, plain_state)
    assert all(torch.equal(a, b) for a, b in zip(scaled[0][0], scaled[1][0]))


def _optimizer_side_clipped(rank, world):
    # scaler.unscale_ before scaler.step (to clip): each rank's scaler has judged its own gradients before Birder's
    # agreement; the overflowing rank's scaler skips step(), the others call it, and no rank may wait for a collective
    import warnings

    model = Net(overflow=True, overflow_at=1)
    opt = Birder(model.parameters(), lr=0.01, beta=0.9, seed=3, process_group=dist.group.WORLD)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    skipped = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for t in range(3):
            x, y = _batch(rank, t)
            scaler.scale(model(x, y)["loss"]).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            skipped.append(opt.step_was_skipped)
            opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], skipped, scaler.get_scale()


def test_fp16_with_the_optimizer_side_all_reduce_and_clipping_skips_everywhere_without_waiting():
    res = run_distributed(_optimizer_side_clipped, 2, timeout=120)
    for params, skipped, _ in res:
        assert skipped == [False, True, False]
        assert all(torch.equal(a, b) for a, b in zip(params, res[0][0]))
    assert [scale for *_, scale in res] == [SCALE, SCALE / 2]  # only rank 1's scaler saw its overflow


# --------------------------------------------------------------------------------------------------- Trainer
class Regression(torch.utils.data.Dataset):
    def __init__(self, n=192):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, 8)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _trainer_run(rank, world, out_dir, scaled, steps=6):
    from transformers import TrainingArguments

    from birder_hf.integrations.transformers import BirderArguments, BirderTrainer

    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=0.01,
        lr_scheduler_type="linear",
        weight_decay=0.1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
    )
    trainer = BirderTrainer(
        model=Net(overflow=True), args=args, train_dataset=Regression(), birder_args=BirderArguments(beta=0.9)
    )
    if scaled:  # what accelerate builds for fp16=True on an accelerator
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10**6)
    trainer.train()
    return {
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "state": _state(trainer.optimizer.optimizer),
        "scheduler_steps": trainer.lr_scheduler.last_epoch,
        "lrs": [e["learning_rate"] for e in trainer.state.log_history if "loss" in e],
        "grad_norm_logged": any("grad_norm" in e for e in trainer.state.log_history),
        "skipped_steps": trainer.birder_hook_state.skipped_steps,
        "scale": trainer.accelerator.scaler.get_scale() if scaled else None,
    }


def test_trainer_fp16_equals_the_unscaled_run_and_a_skipped_step_holds_the_lr_schedule(tmp_path):
    from test_integrations import _launcher_env

    scaled, plain = (
        run_distributed(
            _trainer_run, 2, str(tmp_path / str(s)), s, timeout=300, local_world_size=2, env=_launcher_env()
        )
        for s in (True, False)
    )
    for s, p in zip(scaled, plain):
        for r in (s, p):  # with a GradScaler, and Birder's own skip without one
            assert r["skipped_steps"] == 1
            # 6 Trainer steps, 1 skipped: the scheduler stepped 5 times; the step after the skip used the first lr
            assert r["scheduler_steps"] == 5 and r["lrs"][0] == r["lrs"][1] == 0.01
            assert not r["grad_norm_logged"]  # the norm of d (or of d / S) says nothing about the gradient
        assert s["scale"] == SCALE / 2
        assert all(torch.equal(a, b) for a, b in zip(s["params"], p["params"]))
        _assert_same_state(s["state"], p["state"])
    assert all(torch.equal(a, b) for a, b in zip(scaled[0]["params"], scaled[1]["params"]))


# -------------------------------------------------------------------------------------------------- refusals
def _refusals(rank, world):
    from accelerate import Accelerator

    from birder_hf import OneBitAdam, attach_ddp_hook
    from birder_hf.integrations.accelerate import register_birder_hook

    errors = {}
    x, y = _batch(rank, 0)

    # un-scaling .grad after the hook (what clip_grad_norm_ does with fp16) would divide d by the scale
    model = torch.nn.parallel.DistributedDataParallel(Net())
    opt = Birder(model.parameters(), lr=0.01, seed=0)
    attach_ddp_hook(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(model(x, y)["loss"]).backward()
    scaler.unscale_(opt)
    try:
        scaler.step(opt)
    except RuntimeError as exc:
        errors["unscaled"] = str(exc)
    unchanged = all(st["step"] == 0 for st in opt.state.values())

    # a hook not given the scaler encoded this backward at scale 1, the scaler stepped at 4096: refused, none applied
    model = torch.nn.parallel.DistributedDataParallel(Net())
    opt = Birder(model.parameters(), lr=0.01, seed=0)
    attach_ddp_hook(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(model(x, y)["loss"]).backward()
    try:
        scaler.step(opt)
    except RuntimeError as exc:
        errors["no_scaler"] = str(exc)
    unchanged = (
        unchanged
        and all(st["step"] == 0 for st in opt.state.values())
        and all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    )
    model = torch.nn.parallel.DistributedDataParallel(Net())
    opt = Birder(model.parameters(), lr=0.01, seed=0)
    try:
        attach_ddp_hook(model, opt, grad_scaler=SCALE)
    except TypeError as exc:
        errors["not_a_scaler"] = str(exc)

    # 1-bit Adam's step depends on the gradient's scale: refused in step() and at registration
    model = torch.nn.parallel.DistributedDataParallel(Net())
    opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=2)
    attach_ddp_hook(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(model(x, y)["loss"]).backward()
    try:
        scaler.step(opt)
    except RuntimeError as exc:
        errors["onebitadam_step"] = str(exc)
    model = torch.nn.parallel.DistributedDataParallel(Net())
    opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=2)
    try:
        attach_ddp_hook(model, opt, grad_scaler=torch.amp.GradScaler("cpu"))
    except ValueError as exc:
        errors["onebitadam_hook"] = str(exc)
    acc = Accelerator(cpu=True)
    acc.scaler = torch.amp.GradScaler("cpu")
    model = Net()
    model, opt = acc.prepare(model, OneBitAdam(model.parameters(), lr=0.01, freeze_step=2))
    try:
        register_birder_hook(acc, model, opt)
    except ValueError as exc:
        errors["onebitadam_accelerate"] = str(exc)
    return errors, unchanged


def troubleshooting_message(row_start: str) -> str:
    """The message docs/TROUBLESHOOTING.md quotes ("with the message as the code words it") in its fp16 table row
    that starts with ``row_start``."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "TROUBLESHOOTING.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith(f"| {row_start}"))
    return row.split(" | ")[1].split("`")[1]


def test_fp16_refusals():
    for errors, unchanged in run_distributed(_refusals, 2, local_world_size=2):
        # the troubleshooting page quotes these two word for word
        assert errors["unscaled"] == troubleshooting_message("`scaler.unscale_(optimizer)`") and unchanged
        assert errors["onebitadam_step"] == troubleshooting_message("1-bit Adam with fp16")
        assert (
            "cannot train with fp16 loss scaling" in errors["onebitadam_step"] and "bf16" in errors["onebitadam_step"]
        )
        assert "mixed_precision='bf16'" in errors["onebitadam_accelerate"]
        assert "at loss scale 1" in errors["no_scaler"] and "scaled the loss by 4096" in errors["no_scaler"]
        assert "grad_scaler=" in errors["no_scaler"] and "Nothing was applied" in errors["no_scaler"]
        assert "grad_scaler must be the torch.amp.GradScaler" in errors["not_a_scaler"]
        assert "cannot train with fp16 loss scaling" in errors["onebitadam_hook"]


def _scaler_leftovers(rank, world):
    from birder_hf import attach_ddp_hook

    x, y = _batch(rank, 0)
    out = {}

    # a step refused inside GradScaler.step: torch deletes grad_scale/found_inf only after a step that returned
    model = torch.nn.parallel.DistributedDataParallel(Net())
    opt = Birder(model.parameters(), lr=0.01, seed=0)
    attach_ddp_hook(model, opt)  # no grad_scaler: the hook encodes at scale 1
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaler.scale(model(x, y)["loss"]).backward()
    try:
        scaler.step(opt)
    except RuntimeError as exc:
        out["refused"] = "at loss scale 1" in str(exc)
    out["left_behind"] = [a for a in ("grad_scale", "found_inf") if hasattr(opt, a)]
    opt.zero_grad()
    model(x, y)["loss"].backward()  # the same loop goes on without the scaler: a plain step works
    opt.step()
    out["plain_step_counted"] = all(st["step"] == 1 for st in opt.state.values())

    # a scaler given to the hook but never used: the hook divided the gradients by 2^12, the loss was not scaled
    model = torch.nn.parallel.DistributedDataParallel(Net())
    opt = Birder(model.parameters(), lr=0.01, seed=0)
    state = attach_ddp_hook(model, opt, grad_scaler=torch.amp.GradScaler("cpu", init_scale=SCALE))
    before = [p.detach().clone() for p in model.parameters()]
    model(x, y)["loss"].backward()
    try:
        opt.step()
    except RuntimeError as exc:
        out["unused_scaler"] = str(exc)
    out["unused_scaler_unchanged"] = all(st["step"] == 0 for st in opt.state.values()) and all(
        torch.equal(a, p) for a, p in zip(before, model.parameters())
    )

    # the class for an instance, and a replacement that is no scaler: refused where it is given, not inside backward
    for name, bad in (("class", torch.amp.GradScaler), ("replaced", "fp16")):
        try:
            if name == "class":
                model = torch.nn.parallel.DistributedDataParallel(Net())
                attach_ddp_hook(model, Birder(model.parameters(), lr=0.01, seed=0), grad_scaler=bad)
            else:
                state.grad_scaler = bad
        except TypeError as exc:
            out[name] = str(exc)
    return out


def test_scaler_leftovers_and_misuse_are_refused_where_they_happen():
    for out in run_distributed(_scaler_leftovers, 2, local_world_size=2):
        assert out["refused"] and out["left_behind"] == [] and out["plain_step_counted"]
        assert "not called by that GradScaler" in out["unused_scaler"]
        assert out["unused_scaler"] == troubleshooting_message("a hook given a `GradScaler`")  # quoted there too
        assert "scaler.step(optimizer)" in out["unused_scaler"]
        assert "Nothing was applied" in out["unused_scaler"] and out["unused_scaler_unchanged"]
        assert "is a class" in out["class"] and "GradScaler(...)" in out["class"]
        assert "grad_scaler must be the torch.amp.GradScaler" in out["replaced"]
