"""Birder in one process: reference equivalence, invariants, state dicts, edge cases, bad input."""

import io
import warnings

import pytest
import torch
from _dist import run_distributed

from birder_hf import Birder
from birder_hf.optim import birder
from birder_hf.reference import BirderReference


def _params(seed=0, dtype=torch.float64, shapes=((13, 7), (29,), (3, 4, 5))):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g, dtype=p.dtype) * scale for p in params]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("quantize", [True, False])
@pytest.mark.parametrize("foreach", [False, True])
def test_matches_reference_for_100_steps(amsgrad, quantize, foreach):
    fast_p, ref_p = _params(), _params()
    kw = dict(lr=0.01, beta=0.9, weight_decay=0.1, quantize=quantize, amsgrad=amsgrad, seed=42)
    fast = Birder(fast_p, foreach=foreach, **kw)
    ref = BirderReference(ref_p, **kw)
    for t in range(100):
        scale = 10.0 ** ((t % 7) - 3)  # gradients over 6 orders of magnitude
        for p, q, g in zip(fast_p, ref_p, _grads(fast_p, t, scale)):
            g.view(-1)[:3] = 0.0  # coordinates whose gradient is always 0 (u = 0: d = 0, decay only)
            p.grad, q.grad = g.clone(), g.clone()
        fast.step()
        ref.step()
        for p, q in zip(fast_p, ref_p):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    for i, p in enumerate(fast_p):  # the same arithmetic (every product rounded, then the sum): the same bits
        assert torch.equal(fast.state[p]["exp_avg"], ref.m[i])
        assert torch.equal(fast.state[p]["exp_avg_abs"], ref.b[i])
        assert fast.state[p]["step"].item() == 100


def test_foreach_equals_single_tensor_bitwise():
    a, b = _params(dtype=torch.float32), _params(dtype=torch.float32)
    oa, ob = Birder(a, lr=0.1, weight_decay=0.01, seed=1, foreach=True), Birder(b, lr=0.1, weight_decay=0.01, seed=1)
    for t in range(20):
        for p, q, g in zip(a, b, _grads(a, t)):
            p.grad, q.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert torch.equal(oa.state[p]["exp_avg"], ob.state[q]["exp_avg"])


def _encode_inputs(n, dtype):
    g = torch.Generator().manual_seed(n)
    grad = torch.randn(n, generator=g, dtype=dtype)
    grad[::7], grad[1::11] = 0.0, -0.0  # stale coordinates (and a negative zero)
    m = torch.randn(n, generator=g, dtype=dtype) * 0.1
    b = m.abs() + torch.rand(n, generator=g, dtype=dtype) * 0.1
    m[3::17], b[3::17] = 0.0, 0.0  # never a gradient: u = 0/0 := 0
    b[5::19] = m[5::19].abs()  # |u| = 1
    return grad, m, b


def _encode_paths(rank, world, dtype):
    """Every path's (m, b, max b, u) for each stale mode, amsgrad and maximize (with a loss scale); run in a forked
    rank so that this process's compiler and its threads stay out of the test process (whose later forks run
    autograd)."""
    from birder_hf.optim import EncodeOut, birder_encode
    from birder_hf.quantize import _codec, set_codec_compile

    grad, m, b = _encode_inputs(10_007, dtype)
    mismatches, states_touched = [], []
    set_codec_compile(True)
    for stale in ("fade", "lazy", "keep"):
        for amsgrad in (False, True):
            for maximize, scale in ((False, 1.0), (True, 1024.0)):
                results = []
                for path in ("compiled", "compiled staged", "eager", "foreach"):
                    set_codec_compile(path.startswith("compiled"))
                    mm, bb = m.clone(), b.clone()
                    bmax = [b * 1.25] if amsgrad else None
                    kw = dict(beta=0.9, maximize=maximize, foreach=path == "foreach", stale=stale, grad_scale=scale)
                    if path == "compiled staged":  # the hook's: new m, b, u into other buffers, state kept
                        out = EncodeOut([torch.empty_like(m)], [torch.empty_like(b)], None, [torch.empty_like(m)])
                        if amsgrad:
                            out = out._replace(max_exp_avg_abss=[torch.empty_like(b)])
                        u = birder_encode([grad * scale], [mm], [bb], bmax, out=out, **kw)[0]
                        if not (torch.equal(mm, m) and torch.equal(bb, b)):
                            states_touched.append((stale, amsgrad, maximize))
                        mm, bb, bmax = out.exp_avgs[0], out.exp_avg_abss[0], out.max_exp_avg_abss
                    else:
                        u = birder_encode([grad * scale], [mm], [bb], bmax, **kw)[0]
                    results.append((mm, bb, bmax[0] if amsgrad else None, u))
                for path, other in zip(("staged", "eager", "foreach"), results[1:]):
                    if not all(x is None or torch.equal(x, y) for x, y in zip(results[0], other)):
                        mismatches.append((stale, amsgrad, maximize, path))
    return mismatches, states_touched, sorted(_codec._failed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_encode_gives_the_eager_and_foreach_bits(dtype):
    # the CPU encode runs as one compiled kernel; the eager kernel (no compiler, small tensors), the foreach path
    # (CUDA's default) and the staged hook path must give the same m, b, max b and u, bit for bit; the staged call
    # leaves the state alone (it follows an in-place call of the same graph)
    [(mismatches, states_touched, failed)] = run_distributed(_encode_paths, 1, dtype, timeout=600)
    assert failed == [] and states_touched == [] and mismatches == []


def test_encode_of_non_contiguous_tensors_gives_the_same_bits():
    # strided state (a channels_last parameter) takes the eager path with Python scalars: the same bits
    from birder_hf.optim import birder_encode

    g = torch.Generator().manual_seed(5)
    grad, m = torch.randn(64, 48, generator=g), torch.randn(64, 48, generator=g) * 0.1
    grad[::3] = 0.0
    b = m.abs() + 0.05
    for stale in ("fade", "lazy", "keep"):
        for amsgrad in (False, True):
            runs = []
            for strided in (False, True):
                t = [x.clone() for x in (grad, m, b, b * 1.3)]
                if strided:
                    t = [x.t().contiguous().t() for x in t]
                kw = dict(beta=0.9, maximize=True, stale=stale, grad_scale=8.0)
                u = birder_encode([t[0]], [t[1]], [t[2]], [t[3]] if amsgrad else None, **kw)[0]
                runs.append([u.contiguous(), *(x.contiguous() for x in t[1:])])
            assert all(torch.equal(x, y) for x, y in zip(*runs)), (stale, amsgrad)


def test_quantize_false_is_exactly_the_update_rule():
    (x,) = _params(shapes=((50,),))
    x0 = x.detach().clone()
    opt = Birder([x], lr=0.05, beta=0.8, weight_decay=0.3, quantize=False)
    g = torch.randn(50, dtype=torch.float64)
    x.grad = g
    opt.step()
    m, b = 0.2 * g, 0.2 * g.abs()
    u = m / b
    torch.testing.assert_close(x.detach(), x0 - 0.05 * (u + 0.3 * x0), rtol=0, atol=1e-15)


def test_invariants_under_adversarial_gradients():
    # sign flips, huge and tiny magnitudes, exact zeros, subnormals: |m| <= b, u in [-1, 1], finite state
    p = torch.zeros(6, dtype=torch.float32, requires_grad=True)
    opt = Birder([p], lr=1e-3, beta=0.99, seed=0)
    seq = [
        [1e30, -1e30, 0.0, 1e-45, -3e38, 1.0],
        [-1e30, 1e30, 0.0, -1e-45, 3e38, -1.0],
        [1e-30, 5.0, 0.0, 1e-40, -1e-38, 0.0],
    ] * 20
    for g in seq:
        p.grad = torch.tensor(g, dtype=torch.float32)
        opt.step()
        m, b = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_abs"]
        assert torch.isfinite(m).all() and torch.isfinite(b).all()
        assert torch.all(m.abs() <= b)
        u = m / b.clamp_min(torch.finfo(torch.float32).tiny)
        assert torch.all(u.abs() <= 1)
        assert torch.isfinite(p).all()


def test_every_step_is_bounded_by_lr():
    (x,) = _params(shapes=((1000,),))
    opt = Birder([x], lr=0.01, weight_decay=0.5, seed=0)
    for _ in range(10):
        before = x.detach().clone()
        x.grad = torch.randn(1000, dtype=torch.float64) * 1e6
        opt.step()
        assert torch.all((x.detach() - before).abs() <= 0.01 * (1 + 0.5 * before.abs()) + 1e-12)


def test_state_dict_round_trip_weights_only_then_lockstep():
    a = _params(dtype=torch.float32)
    oa = Birder(a, lr=0.01, weight_decay=0.1, amsgrad=True, seed=7)
    for t in range(5):
        for p, g in zip(a, _grads(a, t)):
            p.grad = g
        oa.step()
    buf = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in a], "optim": oa.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    b = [t.clone().requires_grad_() for t in loaded["model"]]
    ob = Birder(b, lr=0.01, weight_decay=0.1, amsgrad=True)  # another seed: the checkpoint's wins
    ob.load_state_dict(loaded["optim"])
    assert ob.seed == 7
    for t in range(5, 25):
        for p, q, g in zip(a, b, _grads(a, t)):
            p.grad, q.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
        for p, q in zip(a, b):
            assert torch.equal(p, q)


def test_seeded_determinism_and_seed_from_torch_rng():
    def run(**kw):
        ps = _params(dtype=torch.float32)
        opt = Birder(ps, lr=0.01, **kw)
        for t in range(3):
            for p, g in zip(ps, _grads(ps, t)):
                p.grad = g
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in ps])

    assert torch.equal(run(seed=3), run(seed=3))
    assert not torch.equal(run(seed=3), run(seed=4))
    torch.manual_seed(0)
    a = run()
    torch.manual_seed(0)
    assert torch.equal(a, run())


def test_edge_cases_no_grad_zero_size_zero_gradient_low_precision():
    used = torch.ones(4, requires_grad=True)
    unused = torch.ones(3, requires_grad=True)
    empty = torch.ones(0, requires_grad=True)
    half = torch.ones(8, dtype=torch.bfloat16, requires_grad=True)
    opt = Birder([used, unused, empty, half], lr=0.1, weight_decay=0.0, quantize=False)
    used.grad = torch.zeros(4)  # gradient always 0: u = 0, no move (quantize=False)
    empty.grad = torch.zeros(0)
    half.grad = torch.full((8,), -2.0, dtype=torch.bfloat16)
    opt.step()
    assert torch.equal(used.detach(), torch.ones(4))
    assert unused not in opt.state  # no grad: skipped, no state
    assert opt.state[empty]["exp_avg"].numel() == 0
    assert opt.state[half]["exp_avg"].dtype == torch.float32  # fp32 state for bf16 params
    # the update is computed in fp32 and rounded once: 1 + 0.1 rounds to bf16 1.1015625
    assert half.dtype == torch.bfloat16 and torch.equal(half.detach(), torch.full((8,), 1.1).bfloat16())


@pytest.mark.parametrize("foreach", [False, True])
def test_zero_gradient_coordinates_stay_put_weight_decay_aside(foreach):
    # torch's convention: an all-zero gradient leaves the parameters unchanged. u = 0 gives d = 0 (no fair coin),
    # still unbiased; weight decay still applies. Half the coordinates get a gradient and keep moving by +-lr.
    p, still = torch.full((20_000,), 0.5, requires_grad=True), torch.full((20_000,), 0.5, requires_grad=True)
    opt = Birder([p], lr=0.1, weight_decay=0.2, seed=0, foreach=foreach)
    opt_still = Birder([still], lr=0.1, seed=0, foreach=foreach)
    g = torch.zeros(20_000)
    g[::2] = torch.randn(10_000)
    decayed = torch.tensor(0.5)
    for _ in range(3):
        p.grad, still.grad = g.clone(), torch.zeros(20_000)
        opt.step()
        opt_still.step()
        decayed.mul_(1 - 0.1 * 0.2)
    assert torch.all(still.detach() == 0.5)
    assert torch.all(p.detach()[1::2] == decayed)
    assert torch.all((p.detach()[::2] - decayed).abs() > 0.25)  # u = sign(g): three steps of lr the same way
    # the functional form: d = 0 exactly where u = 0 (here u = sign(g))
    x, grad = torch.ones(6), torch.tensor([0.0, 1.0, -1.0, 0.0, 0.5, 0.0])
    ds = birder([x], [grad], [torch.zeros(6)], [torch.zeros(6)], keys=[(1, 2)], lr=0.1, beta=0.9, weight_decay=0.0)
    assert ds[0].tolist() == [0.0, 1.0, -1.0, 0.0, 1.0, 0.0]
    assert torch.equal(x, 1 - 0.1 * ds[0])


def test_maximize_and_closure():
    x = torch.zeros(3, requires_grad=True)
    opt = Birder([x], lr=0.1, quantize=False, maximize=True)

    def closure():
        opt.zero_grad()
        loss = (x * torch.tensor([1.0, -1.0, 2.0])).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 0.0
    torch.testing.assert_close(x.detach(), torch.tensor([0.1, -0.1, 0.1]))


def test_param_groups_have_their_own_hyperparameters():
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    opt = Birder([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1, quantize=False)
    a.grad, b.grad = torch.ones(2), torch.ones(2)
    opt.step()
    assert torch.allclose(a, torch.full((2,), -0.1)) and torch.allclose(b, torch.full((2,), -0.5))


def test_non_finite_gradient_skips_the_step_and_keeps_state():
    p = torch.ones(4, requires_grad=True)
    opt = Birder([p], lr=0.1, seed=0)
    p.grad = torch.ones(4)
    opt.step()
    snapshot = {k: v.clone() for k, v in opt.state[p].items()}
    x = p.detach().clone()
    p.grad = torch.tensor([1.0, float("nan"), 1.0, float("inf")])
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert torch.equal(p.detach(), x)
    for k, v in snapshot.items():
        assert torch.equal(opt.state[p][k], v)


def test_sparse_gradients_raise():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = Birder(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "learning rate"),
        (dict(beta=1.0), "beta"),
        (dict(beta=-0.1), "beta"),
        (dict(weight_decay=-0.1), "weight_decay"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Birder([torch.zeros(1, requires_grad=True)], **kwargs)


def test_unknown_keyword_and_bad_group():
    with pytest.raises(TypeError):
        Birder([torch.zeros(1, requires_grad=True)], betas=(0.9, 0.99))
    with pytest.raises(ValueError, match="beta"):
        Birder([{"params": [torch.zeros(1, requires_grad=True)], "beta": 2.0}])


def test_no_collective_without_a_process_group(monkeypatch):
    import torch.distributed as dist

    def boom(*a, **k):
        raise AssertionError("a collective ran in single-process mode")

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "broadcast"):
        monkeypatch.setattr(dist, name, boom)
    p = torch.ones(5, requires_grad=True)
    opt = Birder([p], lr=0.1)
    p.grad = torch.ones(5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def test_no_amsgrad_buffer_when_off():
    p = torch.ones(5, requires_grad=True)
    opt = Birder([p], lr=0.1)
    p.grad = torch.ones(5)
    opt.step()
    assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_abs"}


def test_lazy_public_names_are_all_exported():
    import birder_hf

    assert sorted(birder_hf.__all__) == sorted([*birder_hf._EXPORTS, "__version__"])
    for name in birder_hf._EXPORTS:
        assert getattr(birder_hf, name).__name__ == name
