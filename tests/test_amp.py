"""fp16 loss scaling (``torch.amp.GradScaler``) with the 1-bit hook, on real ranks: accelerate's
``AcceleratedOptimizer`` and the HF Trainer, each against the same run without loss scaling.

Birder's ``u = m / b`` does not change when every gradient is multiplied by the same power of two, so the hook encodes
the scaled gradients as they are and the optimizer tells the scaler not to un-scale ``.grad`` (which holds ``d``). With
a constant scale a scaled run is bit for bit the unscaled one. An overflow on one rank makes the last bucket's ``d``
NaN on every rank: every rank's scaler skips ``step()`` and halves the scale, accelerate and the Trainer see a skipped
step, and ``m``, ``b`` and the parameters stay as they were. Before the fix the update was ``lr * d / S`` and the scale
never backed off.

accelerate builds a ``GradScaler`` for ``mixed_precision="fp16"`` only on accelerators, so these CPU tests give the
``Accelerator`` a ``GradScaler("cpu")`` (its ``scaler`` attribute, which ``prepare`` and ``backward`` use); the
control flow is the one a GPU run takes (CUDA: ``tests/test_gpu_amp.py``). The overflow is the first step, as with a
too-large initial scale: afterwards the scale stays constant, and the run without a scaler skips the same step.
"""

import torch
from _dist import run_distributed

from birder_hf import Birder

SCALE = 2.0**12


class Net(torch.nn.Module):
    """A small regressor whose loss overflows on rank 1's first forward (``overflow=True``)."""

    def __init__(self, overflow: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.overflow, self.calls = overflow, 0

    def forward(self, x, labels=None):
        out = self.body(x).squeeze(-1)
        loss = None if labels is None else torch.nn.functional.mse_loss(out, labels)
        if loss is not None and self.training:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            if self.overflow and self.calls == 0 and rank == 1:
                loss = loss * float("inf")
            self.calls += 1
        return {"loss": loss, "logits": out}


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=g)
    return x, x @ torch.linspace(-1, 1, 8)


def _state(opt):
    return [{k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]]


def _accelerate_run(rank, world, scaled, steps=6):
    from accelerate import Accelerator

    from birder_hf.integrations.accelerate import register_birder_hook

    acc = Accelerator(cpu=True)
    if scaled:
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10**6)
    model = Net(overflow=True)
    opt = Birder(model.parameters(), lr=0.01, beta=0.9, weight_decay=0.1, seed=3)
    model, opt = acc.prepare(model, opt)
    state = register_birder_hook(acc, model, opt)
    skipped, before = [], None
    for t in range(steps):
        x, y = _batch(rank, t)
        acc.backward(model(x, y)["loss"])
        if t == 0:
            before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        skipped.append(opt.step_was_skipped)
        if t == 0:
            unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and all(
                st["step"] == 0 and not st["exp_avg"].any() and not st["exp_avg_abs"].any() for st in _state(opt)
            )
        opt.zero_grad()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": _state(opt.optimizer),
        "accelerate_skipped": skipped,
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
        _assert_state_scaled(s["state"], p["state"], SCALE / 2)
    assert all(torch.equal(a, b) for a, b in zip(scaled[0]["params"], scaled[1]["params"]))


def _assert_state_scaled(scaled, plain, factor):
    # m and b are EMAs of the scaled gradients: the unscaled ones times the scale, exactly (a power of two)
    for a, b in zip(scaled, plain):
        assert torch.equal(a["step"], b["step"])
        assert torch.equal(a["exp_avg"], b["exp_avg"] * factor)
        assert torch.equal(a["exp_avg_abs"], b["exp_avg_abs"] * factor)


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
        _assert_state_scaled(s["state"], p["state"], SCALE / 2)
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
    acc = Accelerator(cpu=True)
    acc.scaler = torch.amp.GradScaler("cpu")
    model = Net()
    model, opt = acc.prepare(model, OneBitAdam(model.parameters(), lr=0.01, freeze_step=2))
    try:
        register_birder_hook(acc, model, opt)
    except ValueError as exc:
        errors["onebitadam_accelerate"] = str(exc)
    return errors, unchanged


def test_fp16_refusals():
    for errors, unchanged in run_distributed(_refusals, 2, local_world_size=2):
        assert "Do not unscale or clip with the 1-bit hook" in errors["unscaled"] and unchanged
        assert (
            "cannot train with fp16 loss scaling" in errors["onebitadam_step"] and "bf16" in errors["onebitadam_step"]
        )
        assert "mixed_precision='bf16'" in errors["onebitadam_accelerate"]
