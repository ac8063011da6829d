"""The Birder DDP communication hook on real gloo ranks (forked processes)."""

import warnings

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from torch.nn.parallel import DistributedDataParallel as DDP

from birder_hf import Birder, BirderHookState, Topology, birder_hook


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 48), torch.nn.Tanh(), torch.nn.Linear(48, 48), torch.nn.Tanh(), torch.nn.Linear(48, 1)
    ).to(dtype)


def _batch(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 12, generator=g)
    w = torch.linspace(-1, 1, 12).unsqueeze(1)
    return x.to(dtype), (x @ w + 0.1 * torch.randn(16, 1, generator=g)).to(dtype)


def _topology(world):
    return Topology.from_layout(2, 2) if world == 4 else Topology.flat()


def _train_hook(rank, world, method, steps, ddp_kwargs, dtype=torch.float32, accumulate=1, nan_at=None, **opt_kw):
    model = _model(dtype)
    ddp = DDP(model, bucket_cap_mb=0.002, **ddp_kwargs)  # several buckets, rebuilt after step 1
    opt = Birder(model.parameters(), lr=0.02, beta=0.9, weight_decay=0.01, seed=5, **opt_kw)
    state = BirderHookState(opt, topology=_topology(world), method=method)
    ddp.register_comm_hook(state, birder_hook)
    losses = []
    for t in range(steps):
        for micro in range(accumulate):
            x, y = _batch(rank, t * accumulate + micro, dtype)
            if nan_at is not None and t == nan_at and rank == world - 1:
                x = x.clone()
                x[0, 0] = float("nan")
            if micro < accumulate - 1:
                with ddp.no_sync():
                    (ddp(x) - y).pow(2).mean().backward()
            else:
                loss = (ddp(x) - y).pow(2).mean()
                loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return _snapshot(model, opt), losses, state.stats.as_dict(), state.skipped_steps


def _train_reference(rank, world, method, steps, dtype=torch.float32, accumulate=1, skip=(), **opt_kw):
    # No DDP: each rank computes its local gradient and Birder(topology=...) runs the 1-bit all-reduce
    # in step(); the bits are keyed per parameter, so this must equal the hook under any bucket layout.
    model = _model(dtype)
    opt = Birder(
        model.parameters(), lr=0.02, beta=0.9, weight_decay=0.01, seed=5, topology=_topology(world), method=method,
        **opt_kw,
    )  # fmt: skip
    for t in range(steps):
        for micro in range(accumulate):
            x, y = _batch(rank, t * accumulate + micro, dtype)
            (model(x) - y).pow(2).mean().backward()
        if t not in skip:
            opt.step()
        opt.zero_grad()
    return _snapshot(model, opt)


def _snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    ms = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    second = "exp_avg_abs" if opt.defaults["beta2"] is None else "exp_avg_sq"
    bs = [opt.state[p][second].clone() for p in model.parameters()]
    steps = [int(opt.state[p]["step"]) for p in model.parameters()]
    return params, ms, bs, steps


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "method, world", [("allgather", 2), ("scatter_gather", 2), ("hierarchical", 4), ("scatter_gather", 4)]
)
def test_hook_replicas_identical_and_equal_to_the_unbucketed_reference(method, world):
    def fn(rank, world):
        hooked, losses, stats, _ = _train_hook(rank, world, method, 50, {})
        ref = _train_reference(rank, world, method, 50)
        return hooked, losses, stats, ref

    res = run_distributed(fn, world)
    (params0, *_), losses0, stats0, _ = res[0]
    for (params, ms, bs, steps), _, _, (rparams, rms, rbs, rsteps) in res:
        assert _equal(params, params0)  # replicas bitwise identical after 50 steps
        assert _equal(params, rparams)  # bucket layout (and its rebuild) does not change a bit
        assert _equal(ms, rms) and _equal(bs, rbs)  # m, b are the EMAs of this rank's own gradients
        assert steps == rsteps == [50] * len(steps)
    assert not _equal(res[0][0][1], res[1][0][1])  # and those differ between ranks
    assert sum(losses0[-5:]) < 0.3 * sum(losses0[:5])  # it learns
    assert stats0["comm/calls"] >= 50 and stats0["comm/compression_ratio"] > 8


@pytest.mark.parametrize(
    "opt_kw",
    [dict(beta2=0.99, grad_clip=0.05, amsgrad=True), dict(error_feedback=True), dict(beta2=0.99, error_feedback=True)],
    ids=["beta2-clip-amsgrad", "error-feedback", "beta2-error-feedback"],
)
def test_hook_with_the_update_rule_options_equals_the_unbucketed_reference(opt_kw):
    # beta2=, grad_clip= and error_feedback= (issue 38's candidates): the hook encodes bucket by bucket, each tensor
    # clipped to its own share of the norm, each rank's vote error staged and committed with m and b, so bucketing
    # changes no bit here either
    def fn(rank, world):
        hooked, losses, _, _ = _train_hook(rank, world, "hierarchical", 30, {}, **opt_kw)
        return hooked, losses, _train_reference(rank, world, "hierarchical", 30, **opt_kw)

    res = run_distributed(fn, 4)
    (params0, *_), losses0, _ = res[0]
    for (params, ms, vs, steps), _, (rparams, rms, rvs, rsteps) in res:
        assert _equal(params, params0) and _equal(params, rparams)  # (with error feedback: its state made them so)
        assert _equal(ms, rms) and _equal(vs, rvs) and steps == rsteps == [30] * len(steps)
    assert sum(losses0[-5:]) < 0.5 * sum(losses0[:5])  # it learns


def test_gradient_accumulation_with_no_sync():
    def fn(rank, world):
        hooked, *_ = _train_hook(rank, world, "allgather", 6, {}, accumulate=3)
        return hooked, _train_reference(rank, world, "allgather", 6, accumulate=3)

    for hooked, ref in run_distributed(fn, 2):
        assert _equal(hooked[0], ref[0]) and _equal(hooked[1], ref[1])


@pytest.mark.parametrize(
    "ddp_kwargs",
    [dict(static_graph=True), dict(gradient_as_bucket_view=True), dict(find_unused_parameters=True)],
    ids=["static_graph", "gradient_as_bucket_view", "find_unused_parameters"],
)
def test_ddp_options(ddp_kwargs):
    def fn(rank, world):
        hooked, *_ = _train_hook(rank, world, "scatter_gather", 5, ddp_kwargs)
        return hooked, _train_reference(rank, world, "scatter_gather", 5)

    for hooked, ref in run_distributed(fn, 2):
        assert _equal(hooked[0], ref[0])


def test_bf16_buckets():
    def fn(rank, world):
        return _train_hook(rank, world, "allgather", 10, {}, dtype=torch.bfloat16)

    res = run_distributed(fn, 2)
    assert _equal(res[0][0][0], res[1][0][0])
    assert all(p.dtype == torch.bfloat16 for p in res[0][0][0])
    assert all(m.dtype == torch.float32 for m in res[0][0][1])


def test_non_finite_gradient_on_one_rank_skips_the_step_everywhere():
    def fn(rank, world):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hooked, _, _, skipped = _train_hook(rank, world, "allgather", 6, {}, nan_at=3)
        ref = _train_reference(rank, world, "allgather", 6, skip=(3,))
        return hooked, ref, skipped, [str(w.message) for w in caught]

    for hooked, ref, skipped, msgs in run_distributed(fn, 2):
        assert skipped == 1 and any("non-finite" in m for m in msgs)
        # the skipped step left params, m, b and the step counter untouched on every rank
        assert _equal(hooked[0], ref[0]) and _equal(hooked[1], ref[1]) and _equal(hooked[2], ref[2])
        assert hooked[3] == ref[3] == [5] * len(hooked[3])


def test_clear_errors():
    def fn(rank, world):
        model = _model()
        ddp = DDP(model)
        opt = Birder(model.parameters(), lr=0.01)
        state = BirderHookState(opt)
        ddp.register_comm_hook(state, birder_hook)
        errors = {}
        try:
            BirderHookState(opt)
        except ValueError as e:
            errors["twice"] = str(e)
        try:
            ddp.register_comm_hook(state, birder_hook)
        except RuntimeError as e:
            errors["ddp_twice"] = str(e)
        # two backward passes without no_sync before step()
        x, y = _batch(rank, 0)
        (ddp(x) - y).pow(2).mean().backward()
        try:
            (ddp(x) - y).pow(2).mean().backward()
        except RuntimeError as e:
            errors["accumulate"] = str(e)
        # a DDP parameter the optimizer does not own
        model2 = _model()
        ddp2 = DDP(model2)
        opt2 = Birder(list(model2.parameters())[:2], lr=0.01)
        ddp2.register_comm_hook(BirderHookState(opt2), birder_hook)
        try:
            (ddp2(x) - y).pow(2).mean().backward()
        except RuntimeError as e:
            errors["foreign"] = str(e)
        for bad in (dict(method="ring"), dict(topology=None, method="hierarchical", chunk_numel=None)):
            try:
                BirderHookState(Birder(model.parameters(), quantize=False), **bad)
            except ValueError as e:
                errors.setdefault("bad", []).append(str(e))
        return errors

    errors = run_distributed(fn, 2)[0]
    assert "already has a hook state" in errors["twice"]
    assert "only be called once" in errors["ddp_twice"]
    assert "no_sync" in errors["accumulate"]
    assert "not in the Birder optimizer" in errors["foreign"]
    assert len(errors["bad"]) == 2


def test_warns_when_used_under_ddp_without_the_hook():
    def fn(rank, world):
        import birder_hf.base as base

        base._warned_without_communicator.clear()
        model = _model()
        ddp = DDP(model)
        opt = Birder(model.parameters(), lr=0.01)
        x, y = _batch(rank, 0)
        (ddp(x) - y).pow(2).mean().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
            opt.step()
        return [str(w.message) for w in caught if "without its communication hook" in str(w.message)]

    assert all(len(msgs) == 1 for msgs in run_distributed(fn, 2))


def test_hook_state_is_not_picklable():
    import pickle

    def fn(rank, world):
        state = BirderHookState(Birder(_model().parameters()))
        try:
            pickle.dumps(state)
        except TypeError as e:
            return str(e)
        return None

    assert "birder_hf.checkpoint" in run_distributed(fn, 2)[0]


def test_requires_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        BirderHookState(Birder(_model().parameters()))


def test_hook_follows_param_groups_replaced_by_load_state_dict():
    # load_state_dict replaces the group dicts; the hook must read the loaded beta, not a stale copy
    def fn(rank, world):
        model = _model()
        ddp = DDP(model)
        opt = Birder(model.parameters(), lr=0.01, beta=0.9, seed=5)
        ddp.register_comm_hook(BirderHookState(opt), birder_hook)
        other = Birder(_model().parameters(), lr=0.01, beta=0.5, seed=5)
        opt.load_state_dict(other.state_dict())
        x, y = _batch(rank, 0)
        reference = _model()
        (reference(x) - y).pow(2).mean().backward()
        (ddp(x) - y).pow(2).mean().backward()
        opt.step()
        p, g = next(model.parameters()), next(reference.parameters()).grad
        return torch.allclose(opt.state[p]["exp_avg"], 0.5 * g, rtol=0, atol=1e-7)

    assert all(run_distributed(fn, 2))


def _count_settings_checks(rank, world):
    from birder_hf import attach_ddp_hook
    from birder_hf.settings import CommSettings

    checks = []
    real = CommSettings.__post_init__

    def counting(self):
        checks.append(self.method)
        real(self)

    CommSettings.__post_init__ = counting
    try:
        model = _model()
        ddp = DDP(model, bucket_cap_mb=0.002)  # several buckets: several all-reduce calls per step
        opt = Birder(model.parameters(), lr=0.02, seed=5)
        state = attach_ddp_hook(ddp, opt, topology=Topology.flat(), method="allgather", chunk_numel=64)
        for t in range(3):
            x, y = _batch(rank, t)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        return checks, state.comm_settings, state.stats.calls
    finally:
        CommSettings.__post_init__ = real


def test_settings_are_checked_once_and_passed_whole():
    # attach_ddp_hook checks method/inter_method/chunk_numel once; the hook state and every all-reduce call it makes
    # take the checked object whole instead of checking the strings again
    for checks, settings, calls in run_distributed(_count_settings_checks, 2):
        assert calls >= 4, calls  # one bucket on step 1, several after DDP's rebuild went through onebit_all_reduce
        assert checks == ["allgather"], checks
        assert (settings.method, settings.inter_method, settings.chunk_numel) == ("allgather", "allgather", 64)
