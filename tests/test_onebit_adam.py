"""1-bit Adam (the baseline): compressor, warm-up = AdamW, the 1-bit hook on real gloo ranks, exact resume."""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from birder_hf import Topology
from birder_hf.checkpoint import load_rank_state, save_rank_state
from birder_hf.onebit_adam import (
    OneBitAdam,
    OneBitAdamHookState,
    _decompress,
    _server_compress,
    compress_with_feedback,
    onebit_adam_hook,
    shard_layout,
)

BETAS = (0.9, 0.99)


def _model(dtype=torch.float32):
    # odd sizes: uneven shards, a bias of one element (empty shards on most ranks)
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 47), torch.nn.Tanh(), torch.nn.Linear(47, 33), torch.nn.Tanh(), torch.nn.Linear(33, 1)
    ).to(dtype)


def _batch(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 12, generator=g)
    w = torch.linspace(-1, 1, 12).unsqueeze(1)
    return x.to(dtype), (x @ w + 0.1 * torch.randn(16, 1, generator=g)).to(dtype)


def _loss(model, rank, step, dtype=torch.float32):
    x, y = _batch(rank, step, dtype)
    return (model(x) - y).pow(2).mean()


def _setup(freeze_step, lr=0.01, weight_decay=0.01, dtype=torch.float32, scaling="l2", **ddp_kwargs):
    model = _model(dtype)
    ddp = DDP(model, bucket_cap_mb=0.002, **ddp_kwargs)  # several buckets, rebuilt after step 1
    opt = OneBitAdam(
        model.parameters(), lr=lr, betas=BETAS, weight_decay=weight_decay, freeze_step=freeze_step, scaling=scaling
    )
    state = OneBitAdamHookState(opt, topology=Topology.flat())
    ddp.register_comm_hook(state, onebit_adam_hook)
    return model, ddp, opt, state


def _train(rank, ddp, opt, steps, first=0, dtype=torch.float32):
    losses = []
    for t in range(first, first + steps):
        loss = _loss(ddp, rank, t, dtype)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _opt_state(opt):
    # every tensor and number of the per-parameter state, in parameter order
    return [dict(opt.state[p]) for g in opt.param_groups for p in g["params"]]


def _states_equal(a, b):
    for sa, sb in zip(a, b):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]) if torch.is_tensor(sa[k]) else sa[k] == sb[k], k


# ------------------------------------------------------------------------------------------ compressor
@pytest.mark.parametrize("scaling", ["l2", "l1"])
def test_compressor_conserves_on_the_worker_and_on_the_shard_owner(scaling):
    g = torch.Generator().manual_seed(0)
    for numel in (0, 1, 7, 100, 1001):
        for n in (1, 2, 3, 4):
            x = torch.randn(numel, generator=g) * 3
            old = 0.1 * torch.randn(numel, generator=g)
            signs, scales, err = compress_with_feedback(x + old, n, scaling)
            c, lens = shard_layout(numel, n)
            assert signs.shape == (n, c) and scales.shape == (n,) and scales.dtype == torch.float32
            dec = _decompress(signs, scales, torch.float32).view(-1)[:numel]
            torch.testing.assert_close(dec + err, x + old, rtol=0, atol=1e-5)  # decompressed + new error
            for r, (row, length) in enumerate(zip((x + old).split(c) if c else [], lens)):
                want = row.norm() / length**0.5 if scaling == "l2" else row.abs().mean()
                torch.testing.assert_close(scales[r], want.float())
                assert torch.equal(signs[r, :length], row >= 0)
            assert all(scales[r] == 0 for r in range(n) if lens[r] == 0)  # empty shards: scale 0
            # the owner of shard r: mean of the n workers' copies + server error == decompressed + new error
            for r in range(n):
                workers = [compress_with_feedback(torch.randn(numel, generator=g), n, scaling) for _ in range(n)]
                ws, wsc = torch.stack([w[0][r] for w in workers]), torch.stack([w[1][r] for w in workers])
                es = torch.randn(lens[r], generator=g)
                bits, scale, new = _server_compress(ws, wsc, es, scaling)
                mean = _decompress(ws, wsc, torch.float32).mean(0)[: lens[r]]
                got = _decompress(bits, scale, torch.float32).view(-1)
                torch.testing.assert_close(got + new, mean + es, rtol=0, atol=1e-5)


def test_sign_of_zero_is_plus_one_and_all_zero_gives_zero():
    signs, scales, err = compress_with_feedback(torch.zeros(9), 2)
    assert signs.all() and torch.equal(scales, torch.zeros(2)) and torch.equal(err, torch.zeros(9))


# ----------------------------------------------------------------------------------- single process
def test_single_process_warmup_is_adamw_then_compresses():
    model, ref = _model(), _model()
    opt = OneBitAdam(model.parameters(), lr=0.01, betas=BETAS, weight_decay=0.1, freeze_step=4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, betas=BETAS, weight_decay=0.1, foreach=False)
    for t in range(6):
        for m, o in ((model, opt), (ref, ref_opt)):
            _loss(m, 0, t).backward()
            o.step()
            o.zero_grad()
        if t < 4:  # bitwise AdamW during warm-up
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    for p in model.parameters():
        st = opt.state[p]
        assert st["step"] == 6 and st["server_shard"] == (0, 1) and st["server_error"].numel() == p.numel()
        # m is the compressed momentum: one magnitude per parameter (n = 1: one shard)
        assert st["exp_avg"].abs().unique().numel() == 1
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_hook_on_one_rank_equals_the_optimizer_alone():
    # a world of one: the frames are single rows whose scales sit at odd byte offsets (the benchmark's one-rank
    # reference failed there); the hook must then compute exactly what OneBitAdam does without one
    def fn(rank, world):
        model, ddp, opt, state = _setup(freeze_step=3)
        _train(rank, ddp, opt, 8)
        return [p.detach().clone() for p in model.parameters()], state.compressed_steps

    [(params, compressed)] = run_distributed(fn, 1)
    ref = _model()
    ref_opt = OneBitAdam(ref.parameters(), lr=0.01, betas=BETAS, weight_decay=0.01, freeze_step=3)
    _train(0, ref, ref_opt, 8)
    assert compressed == 5
    assert all(torch.equal(p, q) for p, q in zip(params, ref.parameters()))


def test_bias_correction_false_is_deepspeeds_rule():
    p = torch.nn.Parameter(torch.ones(3))
    opt = OneBitAdam([p], lr=0.1, betas=BETAS, eps=1e-8, weight_decay=0.5, freeze_step=3, bias_correction=False)
    p.grad = torch.tensor([1.0, -2.0, 0.5])
    opt.step()
    m, v = 0.1 * p.grad, 0.01 * p.grad**2
    torch.testing.assert_close(p.detach(), torch.ones(3) - 0.1 * (m / (v.sqrt() + 1e-8) + 0.5 * torch.ones(3)))


def test_bad_hyperparameters_give_clear_errors():
    params = [torch.nn.Parameter(torch.zeros(2))]
    bad = [
        (dict(lr=-1.0), "lr must be"),
        (dict(betas=(1.0, 0.9)), "betas must be"),
        (dict(betas=(0.9,)), "betas must be"),
        (dict(eps=-1e-8), "eps must be"),
        (dict(weight_decay=-0.1), "weight_decay must be"),
        (dict(freeze_step=0), "freeze_step must be an int >= 1"),
        (dict(freeze_step=2.5), "freeze_step must be"),
        (dict(freeze_step=True), "freeze_step must be"),
        (dict(scaling="l3"), "scaling"),
    ]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            OneBitAdam(params, **{"freeze_step": 10, **kwargs})
    with pytest.raises(TypeError, match="freeze_step"):
        OneBitAdam(params)  # required: there is no good default
    opt = OneBitAdam(params, freeze_step=10)
    with pytest.raises(ValueError, match="lr must be"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "lr": -1.0})
    with pytest.raises(RuntimeError, match="init_process_group"):
        OneBitAdamHookState(opt)
    with pytest.raises(TypeError, match="OneBitAdam"):
        OneBitAdamHookState(torch.optim.Adam(params))


# ------------------------------------------------------------------------------------- on real ranks
def test_warmup_is_adamw_on_the_averaged_gradient_step_for_step():
    def fn(rank, world):
        model, ddp, opt, state = _setup(freeze_step=100, weight_decay=0.1)
        ref = _model()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, betas=BETAS, weight_decay=0.1, foreach=False)
        equal = []
        for t in range(6):
            _train(rank, ddp, opt, 1, first=t)
            grads = []
            for r in range(world):  # every rank's local gradient, averaged as the hook does: sum(g_r / n)
                ref.zero_grad()
                _loss(ref, r, t).backward()
                grads.append([p.grad / world for p in ref.parameters()])
            for p, *gs in zip(ref.parameters(), *grads):
                p.grad = sum(gs[1:], gs[0])
            ref_opt.step()
            equal.append(all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters())))
        ref_m = [ref_opt.state[p]["exp_avg"] for p in ref.parameters()]
        m_equal = all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), ref_m))
        return equal, m_equal, state.stats.compression_ratio, state.warmup_steps, state.compressed_steps

    for equal, m_equal, ratio, warm, compressed in run_distributed(fn, 2):
        assert all(equal) and m_equal  # bitwise, every step
        assert ratio == pytest.approx(1.0) and (warm, compressed) == (6, 0)


@pytest.mark.parametrize("world, dtype", [(2, torch.float32), (4, torch.float32), (2, torch.bfloat16)])
def test_replicas_identical_after_the_switch_and_the_exchange_conserves(world, dtype):
    def fn(rank, world):
        model, ddp, opt, state = _setup(freeze_step=5, dtype=dtype)
        _train(rank, ddp, opt, 19, dtype=dtype)
        params = list(model.parameters())
        before = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()} for p in params]
        local = copy.deepcopy(model)  # this rank's local gradient of the last step, as the hook sees it
        _loss(local, rank, 19, dtype).backward()
        _loss(ddp, rank, 19, dtype).backward()
        opt.step()
        # DDP wrote the synchronized momentum into .grad (in the bucket's dtype)
        grad_is_m = all(torch.equal(p.grad, opt.state[p]["exp_avg"].to(dtype)) for p in params)
        grads = [q.grad.float() for q in local.parameters()]
        ratio = state.last_step_stats.compression_ratio
        assert grad_is_m
        return [p.detach().clone() for p in params], before, _opt_state(opt), grads, ratio, state.compressed_steps

    res = run_distributed(fn, world)
    params0 = res[0][0]
    for params, _, after, _, ratio, compressed in res:
        assert all(torch.equal(p, q) for p, q in zip(params, params0))  # replicas bitwise identical
        assert all(p.dtype == dtype for p in params) and all(s["exp_avg"].dtype == torch.float32 for s in after)
        for s, s0 in zip(after, res[0][2]):
            assert torch.equal(s["exp_avg"], s0["exp_avg"]) and torch.equal(s["exp_avg_sq"], s0["exp_avg_sq"])
        assert compressed == 15 and ratio > 12  # 1 bit + a float32 scale per shard, against fp32
        if dtype == torch.float32:  # the ratios docs/ONEBIT_ADAM.md quotes for this model
            assert ratio == pytest.approx({2: 27.02, 4: 23.46}[world], abs=0.01)
    assert not torch.equal(res[0][2][0]["worker_error"], res[1][2][0]["worker_error"])  # rank-local

    # conservation of the last step, from the states: on every rank, x - new worker error is a valid
    # 1-bit code of x (sign(x) times one scale per shard); on the owners, m_bar + new server error ==
    # mean of the workers' codes + old server error
    for j, numel in enumerate(p.numel() for p in params0):
        c, lens = shard_layout(numel, world)
        codes = []
        for _, before, after, grads, _, _ in res:
            b, a = before[j], after[j]
            x = torch.lerp(b["exp_avg"], grads[j], 1 - BETAS[0]) + b["worker_error"]
            code = (x - a["worker_error"]).view(-1)
            for r in range(world):
                shard, xs = code[r * c : r * c + lens[r]], x.view(-1)[r * c : r * c + lens[r]]
                assert torch.equal(shard >= 0, xs >= 0)
                if lens[r]:
                    torch.testing.assert_close(shard.abs(), shard.abs()[:1].expand_as(shard), rtol=1e-5, atol=1e-6)
            codes.append(code)
        mean = torch.stack(codes).mean(0)
        old = torch.cat([res[r][1][j]["server_error"] for r in range(world)])
        new = torch.cat([res[r][2][j]["server_error"] for r in range(world)])
        assert [res[r][2][j]["server_shard"] for r in range(world)] == [(r, world) for r in range(world)]
        m_bar = res[0][2][j]["exp_avg"].view(-1)
        torch.testing.assert_close(m_bar + new, mean + old, rtol=0, atol=2e-6)


@pytest.mark.parametrize("half, world", [(3, 2), (7, 3)], ids=["resume_before_freeze", "resume_after_freeze"])
def test_exact_resume_across_the_switch(half, world, tmp_path):
    def fn(rank, world, tmp):
        model, ddp, opt, _ = _setup(freeze_step=5)
        _train(rank, ddp, opt, 2 * half)
        straight = [p.detach().clone() for p in model.parameters()], _opt_state(opt)

        model, ddp, opt, _ = _setup(freeze_step=5)
        _train(rank, ddp, opt, half)
        torch.save(model.state_dict(), f"{tmp}/model_{rank}.pt")
        save_rank_state(opt, tmp)
        dist.barrier()

        model = _model()
        model.load_state_dict(torch.load(f"{tmp}/model_{rank}.pt", weights_only=True))
        ddp = DDP(model, bucket_cap_mb=0.002)  # a fresh DDP: one big bucket again, then a rebuild
        opt = OneBitAdam(model.parameters(), lr=0.01, betas=BETAS, weight_decay=0.01, freeze_step=5)
        ddp.register_comm_hook(OneBitAdamHookState(opt, topology=Topology.flat()), onebit_adam_hook)
        load_rank_state(opt, tmp)  # after the hook state: it follows the reloaded param groups
        _train(rank, ddp, opt, half, first=half)
        return straight, ([p.detach().clone() for p in model.parameters()], _opt_state(opt))

    for (params, state), (rparams, rstate) in run_distributed(fn, world, str(tmp_path)):
        assert all(torch.equal(p, q) for p, q in zip(params, rparams))
        _states_equal(state, rstate)
        assert "worker_error" in state[0] and state[0]["step"] == 2 * half


@pytest.mark.parametrize("scaling", ["l2", "l1"])
def test_loss_falls(scaling):
    def fn(rank, world):
        _, ddp, opt, _ = _setup(freeze_step=10, lr=0.02, scaling=scaling)
        return _train(rank, ddp, opt, 60)

    losses = run_distributed(fn, 2)[0]
    assert sum(losses[-5:]) < 0.1 * sum(losses[:5])
    assert sum(losses[-5:]) < sum(losses[5:10])  # and it keeps learning after the switch at step 10


def test_hook_errors_and_world_size_change(tmp_path):
    def fn(rank, world, tmp):
        errors = {}
        model, ddp, opt, state = _setup(freeze_step=1)
        try:
            OneBitAdamHookState(opt)
        except ValueError as e:
            errors["twice"] = str(e)
        _loss(ddp, rank, 0).backward()
        try:
            _loss(ddp, rank, 0).backward()
        except RuntimeError as e:
            errors["accumulate"] = str(e)
        two = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
        try:
            OneBitAdamHookState(
                OneBitAdam([{"params": two[:1]}, {"params": two[1:], "freeze_step": 3}], freeze_step=2)
            )
        except ValueError as e:
            errors["freeze_step"] = str(e)
        # a state saved by one process (server shard 0 of 1), resumed on 2 ranks
        model, ddp, opt, _ = _setup(freeze_step=1)
        solo_model = _model()
        solo = OneBitAdam(solo_model.parameters(), lr=0.01, betas=BETAS, weight_decay=0.01, freeze_step=1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for t in range(2):
                _loss(solo_model, 0, t).backward()
                solo.step()
                solo.zero_grad()
        errors["no_hook"] = [str(w.message) for w in caught]
        if rank == 0:
            save_rank_state(solo, tmp, rank=0, world_size=1)
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_rank_state(opt, tmp)
            _train(rank, ddp, opt, 1, first=2)
        errors["resharded"] = [str(w.message) for w in caught]
        errors["shard"] = opt.state[next(model.parameters())]["server_shard"]
        return errors

    errors = run_distributed(fn, 2, str(tmp_path))[1]
    assert "already has a hook state" in errors["twice"]
    assert "no_sync" in errors["accumulate"]
    assert "share one freeze_step" in errors["freeze_step"]
    assert len(errors["no_hook"]) == 1 and "without its communication hook" in errors["no_hook"][0]
    assert any("restarts from zero" in m for m in errors["resharded"]) and errors["shard"] == (1, 2)


def test_ddp_options_do_not_change_a_bit():
    def fn(rank, world):
        out = []
        for kwargs in (
            {},
            dict(static_graph=True),
            dict(gradient_as_bucket_view=True),
            dict(find_unused_parameters=True),
        ):
            model, ddp, opt, _ = _setup(freeze_step=3, **kwargs)
            _train(rank, ddp, opt, 8)
            out.append(([p.detach().clone() for p in model.parameters()], _opt_state(opt)))
        return out

    for runs in run_distributed(fn, 2):
        for params, state in runs[1:]:
            assert all(torch.equal(p, q) for p, q in zip(params, runs[0][0]))
            _states_equal(state, runs[0][1])


@pytest.mark.parametrize("steps_before", [0, 3], ids=["warm-up", "compressed"])
def test_a_non_finite_gradient_skips_the_step_in_one_process(steps_before):
    """As Birder: a NaN or inf in one gradient element skips the step (parameters, m, v and the error buffers as they
    were, ``step_was_skipped``), in the warm-up and after ``freeze_step``; the next finite step goes on (issue 24)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = OneBitAdam(model.parameters(), lr=0.01, freeze_step=2)
    for _ in range(steps_before):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    params = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    for bad in (float("nan"), float("inf")):
        model(torch.randn(8, 4)).square().mean().backward()
        model.weight.grad[1, 2] = bad
        with pytest.warns(RuntimeWarning, match="non-finite gradient; this step was skipped"):
            opt.step()
        opt.zero_grad()
        assert opt.step_was_skipped
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
        after = opt.state_dict()
        assert all(
            torch.equal(v, after["state"][i][k]) if torch.is_tensor(v) else v == after["state"][i][k]
            for i, st in state["state"].items()
            for k, v in st.items()
        )
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()
    assert not opt.step_was_skipped and all(torch.isfinite(p).all() for p in model.parameters())
