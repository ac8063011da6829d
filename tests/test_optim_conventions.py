"""torch.optim's own conventions, checked against Birder (a small subset adapted from the checks that
``torch/testing/_internal/common_optimizers.py``'s ``optim_db`` drives; written here, nothing imported from it).

Where Birder differs on purpose: a parameter listed twice in one group is an error (torch only warns: it would be
stepped twice); complex and integer parameters are refused at construction; ``differentiable=True`` is refused; a
param-group key that looks like a misspelled or another optimizer's setting is refused (torch keeps it).
"""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

from birder_hf import Birder


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _loss(model, step):
    torch.manual_seed(100 + step)
    return model(torch.randn(8, 5, dtype=next(model.parameters()).dtype)).square().mean()


def _run(model, opt, steps=4, closure=False):
    for step in range(steps):
        opt.zero_grad()
        if closure:
            opt.step(lambda step=step: (_loss(model, step).backward(), None)[1])
        else:
            _loss(model, step).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "params, kwargs, error, match",
    [
        (lambda p: p[0], {}, TypeError, "params argument given to the optimizer should be an iterable"),
        (lambda p: [{"params": p[0]}, {"params": p[0]}], {}, ValueError, "more than one parameter group"),
        (lambda p: [("w", p[0]), p[1]], {}, ValueError, "with/without names"),
        (lambda p: p, {"lr": torch.tensor([1e-3, 1e-3])}, ValueError, "Tensor lr must be 1-element"),
        (lambda p: p, {"lr": -1.0}, ValueError, "Invalid learning rate"),
        (lambda p: p, {"differentiable": True}, ValueError, "differentiable"),
        (lambda p: [torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))], {}, TypeError, "real floating"),
        (lambda p: [p[0], p[0]], {}, ValueError, "appears twice"),  # torch: a UserWarning only
    ],
    ids=["tensor", "across-groups", "names", "tensor-lr-2", "negative-lr", "differentiable", "complex", "twice"],
)
def test_error_inputs(params, kwargs, error, match):
    ps = [torch.nn.Parameter(torch.randn(1, 1)), torch.nn.Parameter(torch.randn(1, 1))]
    with pytest.raises(error, match=match):
        Birder(params(ps), **kwargs)


# ------------------------------------------------------------------------------------------ tensor lr
@pytest.mark.parametrize("foreach", [False, True])
def test_a_one_element_tensor_lr_steps_like_the_float(foreach):
    m1, m2 = _model(), _model()
    float_lr = _run(m1, Birder(m1.parameters(), lr=0.01, weight_decay=0.1, seed=0, foreach=foreach))
    tensor_lr = _run(m2, Birder(m2.parameters(), lr=torch.tensor(0.01), weight_decay=0.1, seed=0, foreach=foreach))
    for a, b in zip(float_lr, tensor_lr):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_scheduler_changes_a_tensor_lr_in_place():
    model = _model()
    lr = torch.tensor(0.01)
    opt = Birder(model.parameters(), lr=lr, seed=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _loss(model, 0).backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr and lr.item() == torch.tensor(0.005).item()  # the same tensor, in place
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    _loss(model, 1).backward()
    opt.step()
    # every coordinate moved by exactly lr * (d + 0) with |d| = 1 (one process, quantize: d = +-1)
    for p, b in zip(model.parameters(), before):
        torch.testing.assert_close((p.detach() - b).abs(), torch.full_like(b, 0.005))


# ----------------------------------------------------------------------------------- state dict, closure
def test_state_dict_round_trip_and_lockstep():
    m1 = _model()
    opt1 = Birder(m1.parameters(), lr=0.01, weight_decay=0.1, amsgrad=True, seed=3)
    _run(m1, opt1, steps=3)
    buf = io.BytesIO()
    torch.save(opt1.state_dict(), buf)
    buf.seek(0)
    m2 = copy.deepcopy(m1)
    opt2 = Birder(m2.parameters(), lr=0.5, seed=99)  # the loaded groups replace these settings
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert opt2.param_groups[0]["lr"] == 0.01 and opt2.seed == 3 and opt2.param_groups[0]["amsgrad"]
    for step in range(3, 6):  # lockstep: the same steps, the same bits
        for m, o in ((m1, opt1), (m2, opt2)):
            o.zero_grad()
            _loss(m, step).backward()
            o.step()
        assert _equal(m1.parameters(), m2.parameters())


def test_an_older_state_dict_without_the_flags_loads_and_steps():
    model = _model()
    opt = Birder(model.parameters(), lr=0.01, seed=0, foreach=True)
    _run(model, opt, steps=2)
    old = copy.deepcopy(opt.state_dict())
    for group in old["param_groups"]:
        for flag in ("foreach", "maximize", "differentiable", "capturable", "fused"):
            group.pop(flag, None)
    fresh = Birder(model.parameters(), lr=0.01, seed=0)
    fresh.load_state_dict(old)
    assert fresh.param_groups[0]["foreach"] is None and fresh.param_groups[0]["maximize"] is False
    _run(model, fresh, steps=1)


def test_step_with_a_closure_returns_its_loss():
    model = _model()
    opt = Birder(model.parameters(), lr=0.01, seed=0)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        loss = _loss(model, 0)
        loss.backward()
        return loss

    with torch.no_grad():  # the closure runs with gradients enabled all the same
        loss = opt.step(closure)
    assert calls == [True] and torch.is_tensor(loss) and loss.requires_grad


def test_closure_and_plain_steps_agree():
    m1, m2 = _model(), _model()
    assert _equal(
        _run(m1, Birder(m1.parameters(), lr=0.01, seed=0), closure=True),
        _run(m2, Birder(m2.parameters(), lr=0.01, seed=0)),
    )


def test_maximize_is_minimizing_the_negated_loss():
    m1, m2 = _model(), _model()
    opt1 = Birder(m1.parameters(), lr=0.01, seed=0, maximize=True)
    opt2 = Birder(m2.parameters(), lr=0.01, seed=0)
    for step in range(3):
        for m, o, sign in ((m1, opt1, 1.0), (m2, opt2, -1.0)):
            o.zero_grad()
            (sign * _loss(m, step)).backward()
            o.step()
    assert _equal(m1.parameters(), m2.parameters())


def test_foreach_and_single_tensor_paths_agree_in_float64():
    m1, m2 = _model().double(), _model().double()
    a = _run(m1, Birder(m1.parameters(), lr=0.01, amsgrad=True, seed=0, foreach=True))
    b = _run(m2, Birder(m2.parameters(), lr=0.01, amsgrad=True, seed=0, foreach=False))
    assert _equal(a, b)


def test_step_hooks_and_deepcopy():
    model = _model()
    opt = Birder(model.parameters(), lr=0.01, seed=0)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append("post"))
    _run(model, opt, steps=1)
    assert seen == ["pre", "post"]
    twin_model = copy.deepcopy(model)
    twin = Birder(twin_model.parameters(), lr=0.01, seed=0)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert _equal(_run(model, opt, steps=2), _run(twin_model, twin, steps=2))


def test_torch_compile_of_step_matches_eager():
    m1, m2 = _model(), _model()
    opt1 = Birder(m1.parameters(), lr=torch.tensor(0.01), weight_decay=0.1, seed=0)
    opt2 = Birder(m2.parameters(), lr=torch.tensor(0.01), weight_decay=0.1, seed=0)
    compiled = torch.compile(opt1.step, backend="eager")  # dynamo traces it (graph breaks allowed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's notes about graph breaks
        for step in range(2):
            for m, fn in ((m1, compiled), (m2, opt2.step)):
                m.zero_grad()
                _loss(m, step).backward()
                fn()
    assert _equal(m1.parameters(), m2.parameters())


# ------------------------------------------------------------------ issue 24: conventions of torch's and timm's suites
def test_a_non_parameter_entry_in_state_loads_as_torch_keeps_it():
    # torch's load-state-dict hook tests (and other libraries) stash entries in optimizer.state that are no parameter's
    model = _model()
    opt = Birder(model.parameters(), lr=0.01, seed=0)
    _run(model, opt, steps=2)
    opt.state["ran_load_state_dict_pre_hook"] = True
    twin_model = copy.deepcopy(model)
    twin = Birder(twin_model.parameters(), lr=0.01, seed=0)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # was: TypeError: argument of type 'bool' is not iterable
    assert twin.state["ran_load_state_dict_pre_hook"] is True
    assert _equal(_run(model, opt, steps=2), _run(twin_model, twin, steps=2))


def _timm_like(lr, lr_fn, **kwargs):
    # timm's test_optimizer_tensor_lr, re-written: two optimizers built alike (no seed given), one lr schedule with
    # lr = 0 on some steps, as a float written into the group or as one Tensor filled in place (no reseeding between)
    weight = torch.nn.Parameter(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)))
    bias = torch.nn.Parameter(torch.randn(8, generator=torch.Generator().manual_seed(1)))
    opt = Birder([weight, bias], lr=lr, weight_decay=0.1, **kwargs)
    for step in range(5):
        lr_fn(opt, step)
        for i, p in enumerate((weight, bias)):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        opt.step()
    return [weight.detach().clone(), bias.detach().clone()]


@pytest.mark.parametrize("foreach", [False, True])
def test_an_in_place_tensor_lr_with_zero_steps_follows_the_float_schedule(foreach):
    lrs = [1e-2, 5e-3, 0.0, 0.0, 2e-3]
    expected = _timm_like(1e-2, lambda opt, step: opt.param_groups[0].__setitem__("lr", lrs[step]), foreach=foreach)
    lr = torch.tensor(lrs[0])
    actual = _timm_like(lr, lambda opt, step: lr.fill_(lrs[step]), foreach=foreach)
    for a, e in zip(actual, expected):  # before: 60 of 128 weight elements differed (another default seed)
        torch.testing.assert_close(a, e)
    # and lr = 0 moves nothing, weight decay included
    zero = torch.tensor(0.0)
    before = _timm_like(zero, lambda opt, step: None)
    start = [torch.randn(16, 8, generator=torch.Generator().manual_seed(s)) for s in (0,)]
    start.append(torch.randn(8, generator=torch.Generator().manual_seed(1)))
    assert _equal(before, start)


def test_the_default_seed_is_torchs_and_draws_no_random_number():
    torch.manual_seed(123)
    a = Birder([torch.nn.Parameter(torch.zeros(2))])
    after_a = torch.rand(1)
    torch.manual_seed(123)
    b = Birder([torch.nn.Parameter(torch.zeros(2))])
    c = Birder([torch.nn.Parameter(torch.zeros(2))])
    assert a.seed == b.seed == c.seed == 123 % (2**31 - 1)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), after_a)  # building an optimizer left the user's random stream alone
