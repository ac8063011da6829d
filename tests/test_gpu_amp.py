"""Mixed precision and checkpoints on CUDA: fp16 autocast with ``GradScaler("cuda")``, bf16 autocast through
accelerate, and a per-rank checkpoint written on the GPU that loads on the CPU and back.

fp16 loss scaling in one process: ``GradScaler`` un-scales ``.grad`` before ``Birder.step()`` and skips the steps
whose gradients overflowed. Under the DDP hook Birder takes the scaled gradients as they are (``.grad`` holds ``d``);
that path is tested on CPU ranks with ``GradScaler("cpu")`` (``tests/test_amp.py``), not on CUDA yet.
"""

import pytest
import torch
from _cuda import gpu

from birder_hf import Birder
from birder_hf.checkpoint import load_rank_state, save_rank_state

LR, WD = 0.01, 0.01


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))


def _batch(step, device):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 16, generator=g)
    return x.to(device), x[:, :4].sum(1, keepdim=True).to(device)


@gpu
def test_fp16_autocast_with_grad_scaler():
    model = _mlp().cuda()
    opt = Birder(model.parameters(), lr=LR, weight_decay=WD, seed=0)
    # 2^40 overflows fp16: the first steps are skipped (by the scaler) until the scale has come down
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40)
    skipped, losses = 0, []
    for t in range(60):
        x, y = _batch(t, "cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = (model(x).float() - y).pow(2).mean()
        before = [p.detach().clone() for p in model.parameters()]
        state_before = [st["exp_avg"].clone() for st in opt.state.values()]
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if scaler.get_scale() < scale:  # overflow: the step was skipped, Birder never saw the gradients
            skipped += 1
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            assert all(torch.equal(a, st["exp_avg"]) for a, st in zip(state_before, opt.state.values()))
            assert t >= 10 or len(opt.state) == 0
        else:
            for a, p in zip(before, model.parameters()):  # |step| <= lr (1 + wd |x|), in fp32 master weights
                assert p.dtype == torch.float32 and torch.isfinite(p).all()
                assert ((p - a).abs() <= LR * (1 + WD * a.abs()) + 1e-6).all()
            losses.append(loss.item())
    assert skipped >= 10 and len(losses) >= 30
    assert all(st["exp_avg"].dtype == torch.float32 for st in opt.state.values())
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])


def _train_bf16(use_accelerate: bool, steps: int = 10):
    model = _mlp()
    opt = Birder(model.parameters(), lr=LR, weight_decay=WD, seed=0)
    if use_accelerate:
        from accelerate import Accelerator

        from birder_hf.integrations.accelerate import register_birder_hook

        accelerator = Accelerator(mixed_precision="bf16")
        model, opt = accelerator.prepare(model, opt)
        assert accelerator.device.type == "cuda"
        assert register_birder_hook(accelerator, model, opt) is None  # one process: nothing to compress
    else:
        model = model.cuda()
    for t in range(steps):
        x, y = _batch(t, "cuda")
        if use_accelerate:
            loss = (model(x) - y).pow(2).mean()  # accelerate runs forward in autocast, outputs cast to fp32
            accelerator.backward(loss)
        else:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            (out.float() - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    inner = getattr(opt, "optimizer", opt)
    return [p.detach().cpu() for p in model.parameters()], inner


@gpu
def test_bf16_autocast_through_accelerate():
    from accelerate.state import AcceleratorState

    try:
        got, opt = _train_bf16(use_accelerate=True)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    want, _ = _train_bf16(use_accelerate=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # accelerate adds nothing to the arithmetic
    assert all(p.dtype == torch.float32 for p in got)
    assert all(st["exp_avg"].dtype == torch.float32 and st["exp_avg"].is_cuda for st in opt.state.values())


def _params(device):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 33, generator=g).to(device).requires_grad_()
    v = torch.randn(1001, generator=g).to(device, torch.bfloat16).requires_grad_()  # fp32 state
    return [w, v]


def _step(params, opt, t):
    g = torch.Generator().manual_seed(50 + t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
    opt.step()


def _state(opt, params):
    return [
        (opt.state[p]["exp_avg"].cpu(), opt.state[p]["exp_avg_abs"].cpu(), int(opt.state[p]["step"])) for p in params
    ]


@gpu
@pytest.mark.parametrize("amsgrad", [False, True], ids=["plain", "amsgrad"])
def test_checkpoint_saved_on_gpu_loads_on_cpu_and_back(tmp_path, amsgrad):
    gpu_params = _params("cuda")
    gpu_opt = Birder(gpu_params, lr=LR, weight_decay=WD, seed=7, amsgrad=amsgrad)
    for t in range(3):
        _step(gpu_params, gpu_opt, t)
    save_rank_state(gpu_opt, str(tmp_path / "gpu"), rank=0, world_size=1)

    cpu_params = [p.detach().cpu().clone().requires_grad_() for p in gpu_params]
    cpu_opt = Birder(cpu_params, lr=LR, weight_decay=WD, seed=1, amsgrad=amsgrad)  # the checkpoint's seed wins
    load_rank_state(cpu_opt, str(tmp_path / "gpu"), rank=0, world_size=1)
    assert cpu_opt.seed == 7
    for st in cpu_opt.state.values():
        assert not st["exp_avg"].is_cuda and st["exp_avg"].dtype == torch.float32
    assert all(
        torch.equal(a, b)
        for x, y in zip(_state(cpu_opt, cpu_params), _state(gpu_opt, gpu_params))
        for a, b in zip(x[:2], y[:2])
    )

    save_rank_state(cpu_opt, str(tmp_path / "cpu"), rank=0, world_size=1)
    back_params = [p.detach().to("cuda", copy=True).requires_grad_() for p in cpu_params]
    back_opt = Birder(back_params, lr=LR, weight_decay=WD, seed=2, amsgrad=amsgrad)
    load_rank_state(back_opt, str(tmp_path / "cpu"), rank=0, world_size=1)
    assert all(st["exp_avg"].is_cuda and st["exp_avg"].dtype == torch.float32 for st in back_opt.state.values())

    # every copy continues exactly where the original goes
    for params, opt in ((gpu_params, gpu_opt), (back_params, back_opt), (cpu_params, cpu_opt)):
        _step(params, opt, 3)
    for other_params, other_opt in ((back_params, back_opt), (cpu_params, cpu_opt)):
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(other_params, gpu_params))
        for x, y in zip(_state(other_opt, other_params), _state(gpu_opt, gpu_params)):
            assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2] == y[2] == 4
