"""``Birder.step()`` on CUDA (one process): the same result as on the CPU, foreach and for-loop, bf16 parameters.

Same seed, same gradients (made on the CPU), same parameters: the EMAs are elementwise float32 arithmetic (the CPU's
vectorized ``add(alpha=)`` and CUDA's both fuse it into one multiply-add), ``u = m / b`` is one IEEE division, and
the bits come from the device-independent codec, so parameters and state must agree bit for bit.
"""

import contextlib

import pytest
import torch
from _cuda import eager_codec, gpu, host_syncs

from birder_hf import Birder

# one tensor above 2^16 elements (the compiled quantizer), others with lengths that are not multiples of 8
SHAPES = [(300, 257), (1001,), (3, 5, 7), (70001,)]
STEPS = 5


def _grads(step, dtype):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * (1 + step)).to(dtype) for s in SHAPES]


def run_birder(device, dtype=torch.float32, foreach=None, **kwargs) -> dict:
    """``STEPS`` Birder steps on ``device`` from fixed parameters and gradients; parameters and state on the CPU.

    On the CPU (the reference) with the eager codec: the same bits without compiling C++ on the device.
    """
    with eager_codec() if device == "cpu" else contextlib.nullcontext():
        return _run_birder(device, dtype, foreach, **kwargs)


def _run_birder(device, dtype, foreach, **kwargs) -> dict:
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_() for s in SHAPES]
    opt = Birder(params, lr=0.01, beta=0.9, weight_decay=0.05, seed=3, foreach=foreach, **kwargs)
    for t in range(STEPS):
        for p, grad in zip(params, _grads(t, dtype)):
            p.grad = grad.to(device)
        opt.step()
    return {
        "params": [p.detach().cpu() for p in params],
        "exp_avg": [opt.state[p]["exp_avg"].cpu() for p in params],
        "exp_avg_abs": [opt.state[p]["exp_avg_abs"].cpu() for p in params],
        "steps": [int(opt.state[p]["step"]) for p in params],
    }


def _assert_same(got, want):
    for key in ("params", "exp_avg", "exp_avg_abs"):
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            assert a.dtype == b.dtype, (key, i, a.dtype, b.dtype)
            n_diff = int((a != b).sum())
            assert n_diff == 0, (
                f"{key}[{i}] {tuple(a.shape)}: {n_diff} elements differ, max |diff| {(a - b).abs().max()}"
            )
    assert got["steps"] == want["steps"] == [STEPS] * len(SHAPES)


@gpu
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
def test_step_on_cuda_equals_cpu(foreach):
    _assert_same(run_birder("cuda", foreach=foreach), run_birder("cpu", foreach=False))


@gpu
def test_amsgrad_and_maximize_on_cuda_equal_cpu():
    _assert_same(run_birder("cuda", amsgrad=True, maximize=True), run_birder("cpu", amsgrad=True, maximize=True))


@gpu
def test_bf16_params_keep_fp32_state_on_cuda():
    got = run_birder("cuda", dtype=torch.bfloat16)  # foreach by default on CUDA
    assert all(p.dtype == torch.bfloat16 for p in got["params"])
    assert all(m.dtype == torch.float32 for m in got["exp_avg"] + got["exp_avg_abs"])
    _assert_same(got, run_birder("cpu", dtype=torch.bfloat16))


@gpu
def test_step_syncs_the_host_once():
    # the finite check (one .item()-like read per device) is the only documented host synchronisation of step()
    params = [torch.randn(s, device="cuda").requires_grad_() for s in SHAPES]
    opt = Birder(params, lr=0.01, seed=1)
    for p, grad in zip(params, _grads(0, torch.float32)):
        p.grad = grad.cuda()
    opt.step()  # warm-up: state, compiled kernels, pinned buffers
    seen = host_syncs(opt.step)
    assert seen["runtime_calls"] > 0, "the profiler saw no CUDA runtime call; it cannot count synchronisations"
    assert len(seen["syncs"]) <= 1, seen


def test_run_birder_on_cpu():
    # CI (no GPU): the comparison itself (for-loop against foreach on the CPU)
    _assert_same(run_birder("cpu", foreach=True), run_birder("cpu", foreach=False))
