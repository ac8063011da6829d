"""1-bit HSDP on real gloo ranks: FSDP2 on the "shard" dimension of a 2 x 2 mesh, Birder's 1 bit across "nodes".

Four forked ranks play 2 nodes x 2. The reference trains the unsharded model: each rank averages its gradient
with its node's other rank (a plain all-reduce), and Birder's optimizer-side 1-bit all-reduce runs over the
replicate group. Sharding must not change a bit of that: the hook and the step() path give the reference's
parameters exactly.
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import birder_hf.collectives as collectives
from birder_hf import Birder, OneBitAdam, Topology
from birder_hf.checkpoint import load_rank_state, save_rank_state
from birder_hf.collectives import expected_bytes
from birder_hf.fsdp import FSDPHookState, register_birder_fsdp

LAYERS = (0, 2, 4)  # odd widths: FSDP pads dim 0, and the last layer's one row leaves rank 1 of a node empty


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 29), torch.nn.Tanh(), torch.nn.Linear(29, 31), torch.nn.Tanh(), torch.nn.Linear(31, 1)
    ).to(dtype)


def _batch(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 12, generator=g)
    w = torch.linspace(-1, 1, 12).unsqueeze(1)
    return x.to(dtype), (x @ w + 0.1 * torch.randn(16, 1, generator=g)).to(dtype)


def _mesh(shape=(2, 2)):
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _sharded(mesh, dtype=torch.float32, **kwargs):
    model = _model(dtype)
    for i in LAYERS:
        fully_shard(model[i], mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _optimizer(params, **kwargs):
    return Birder(params, lr=0.02, beta=0.9, weight_decay=0.01, seed=5, **kwargs)


def _loss(model, rank, step, dtype=torch.float32):
    x, y = _batch(rank, step, dtype)
    return (model(x) - y).float().pow(2).mean()


def _train_hsdp(
    rank, mesh, steps, method, *, in_backward=True, accumulate=1, nan_at=None, dtype=torch.float32, **opt_kw
):
    model = _sharded(mesh["shard"], dtype)
    opt = _optimizer(model.parameters(), **opt_kw)
    comm = register_birder_fsdp(model, opt, mesh, method=method, in_backward=in_backward)
    losses = []
    for t in range(steps):
        for micro in range(accumulate):
            model.set_requires_gradient_sync(micro == accumulate - 1)  # accumulate unsharded, reduce once
            loss = _loss(model, rank, t * accumulate + micro, dtype)
            if nan_at == t and rank == 3:
                loss = loss * float("nan")
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, comm, losses


def _train_reference(rank, mesh, steps, method, *, accumulate=1, skip=(), **opt_kw):
    # unsharded: node-average the gradient by hand, then Birder's step() all-reduce over the replicate group
    model = _model()
    opt = _optimizer(model.parameters(), topology=Topology.from_replicate_dim(mesh), method=method, **opt_kw)
    node = mesh["shard"].get_group()
    for t in range(steps):
        for micro in range(accumulate):
            _loss(model, rank, t * accumulate + micro).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=node)
            p.grad.div_(mesh.size(1))
        if t not in skip:
            opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def _full(model):
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("method", ["hierarchical", "scatter_gather"])
def test_sharding_changes_no_bit_replicas_agree_and_state_covers_the_shard(method):
    def fn(rank, world):
        mesh = _mesh()
        ref = _train_reference(rank, mesh, 8, method)
        model, opt, hook, losses = _train_hsdp(rank, mesh, 8, method)
        step_model, *_ = _train_hsdp(rank, mesh, 8, method, in_backward=False)
        acc_model, *_ = _train_hsdp(rank, mesh, 3, method, accumulate=2)
        acc_ref = _train_reference(rank, mesh, 3, method, accumulate=2)
        shards = [
            (tuple(p.to_local().shape), tuple(opt.state[p]["exp_avg"].shape), opt.state[p]["shard"])
            for p in model.parameters()
        ]
        ms = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
        return ref, _full(model), _full(step_model), acc_ref, _full(acc_model), shards, ms, losses, type(hook)

    res = run_distributed(fn, 4)
    for ref, hooked, stepped, acc_ref, acc, shards, _, _, kind in res:
        assert kind is FSDPHookState
        assert _equal(hooked, ref) and _equal(stepped, ref)  # hook, step() path and unsharded reference: bitwise
        assert _equal(acc, acc_ref)  # gradient accumulation with set_requires_gradient_sync(False)
        assert _equal(hooked, res[0][1])  # every rank's full parameters are the same
        for local_shape, state_shape, _ in shards:
            assert state_shape == local_shape  # m, b cover this rank's shard only
    # rank 1 holds rows 15..28 of the first layer's 29: elements 180..359 of its weight, and no row of the last layer
    assert res[1][5][0] == ((14, 12), (14, 12), (180, 168, 348))
    assert res[1][5][4] == ((0, 31), (0, 31), (31, 0, 31))
    assert not torch.equal(res[0][6][0], res[2][6][0])  # m differs between the nodes (their own gradients)
    losses = res[0][7]
    assert losses[-1] < 0.3 * losses[0]


def test_the_update_rule_options_shard_bit_for_bit_and_clipping_keeps_replicas_equal():
    # beta2= and error_feedback= are elementwise: sharding changes no bit; grad_clip= clips each rank's shard to
    # its share of the norm (a different clip from the unsharded one's whole tensor, docs/ALGORITHM.md), and the
    # replicas still agree
    def fn(rank, world):
        mesh = _mesh()
        ref = _train_reference(rank, mesh, 6, "hierarchical", beta2=0.99)
        model, opt, _, _ = _train_hsdp(rank, mesh, 6, "hierarchical", beta2=0.99)
        clipped, _, _, losses = _train_hsdp(rank, mesh, 12, "hierarchical", beta2=0.99, grad_clip=0.05)
        ef_ref = _train_reference(rank, mesh, 6, "hierarchical", error_feedback=True)
        ef, _, _, _ = _train_hsdp(rank, mesh, 6, "hierarchical", error_feedback=True)
        keys = sorted(opt.state[next(model.parameters())])
        return ref, _full(model), _full(clipped), losses, keys, ef_ref, _full(ef)

    res = run_distributed(fn, 4)
    for ref, hooked, clipped, _, keys, ef_ref, ef in res:
        assert _equal(hooked, ref) and _equal(clipped, res[0][2]) and _equal(ef, ef_ref)
        assert "exp_avg_sq" in keys and "exp_avg_abs" not in keys
    assert res[0][3][-1] < 0.5 * res[0][3][0]


def test_only_packed_bits_and_flags_cross_the_nodes():
    def fn(rank, world):
        mesh = _mesh()
        node_of = {r: r // 2 for r in range(4)}
        crossing = []

        def spy(name, fn_, sent):  # sent: the position of the tensor this rank sends
            def wrapper(*args, **kwargs):
                group = kwargs.get("group")
                ranks = dist.get_process_group_ranks(group) if group is not None else list(range(4))
                if len({node_of[r] for r in ranks}) > 1:
                    crossing.append((name, str(args[sent].dtype), args[sent].numel()))
                return fn_(*args, **kwargs)

            return wrapper

        # what FSDP2 and birder_hf call (FSDP's collectives go through these module attributes)
        names = {"all_reduce": 0, "broadcast": 0, "reduce_scatter_tensor": 1, "all_gather_into_tensor": 1}
        names["all_to_all_single"] = 1
        saved = {n: getattr(dist, n) for n in names}
        saved_gather = collectives._all_gather
        try:
            for n, sent in names.items():
                setattr(dist, n, spy(n, saved[n], sent))
            collectives._all_gather = spy("onebit_all_gather", saved_gather, 1)
            model, opt, hook, _ = _train_hsdp(rank, mesh, 3, "hierarchical")
        finally:
            for n in names:
                setattr(dist, n, saved[n])
            collectives._all_gather = saved_gather
        # in backward order: the last layer's unit reduces first
        shard_numels = [sum(p.to_local().numel() for p in model[i].parameters()) for i in reversed(LAYERS)]
        return crossing, shard_numels, hook.stats.as_dict()

    for crossing, shard_numels, stats in run_distributed(fn, 4):
        bits = [c for c in crossing if c[0] == "onebit_all_gather" and c[1] != "torch.int64"]
        flags = [c for c in crossing if c[0] != "onebit_all_gather"]
        # the first call with new arguments checks the ranks agree on them: one all-gather of 7 int64 per new call
        # signature (numel, method, ...), none on later steps (collectives.check_agreement)
        agreement = [i for i, c in enumerate(crossing) if c[0] == "onebit_all_gather" and c[1] == "torch.int64"]
        # step 1's agreement: the finite flag, per parameter whether any rank used it (6 parameters), and the one param
        # group's lr and weight_decay as (x, -x) pairs (the ranks' largest and smallest: the same on every rank)
        verdict = ("all_reduce", "torch.float64", 1 + 6 + 2 * 2)
        first_step_ends = crossing.index(verdict)
        assert agreement and max(agreement) < first_step_ends
        assert all(crossing[i][2] == 7 for i in agreement)
        # per step and FSDP unit: one all-gather of the packed bits of this rank's shard (1 bit per element; none
        # for an empty shard)
        assert bits == [("onebit_all_gather", "torch.uint8", -(-n // 8)) for n in shard_numels if n] * 3
        # and per step one all-reduce of the flags and settings over every rank: no fp32 gradient crosses
        assert flags == [verdict] * 3
        per_step = sum(expected_bytes("hierarchical", n, (2, 1))["inter_node_bytes"] for n in shard_numels)
        assert stats["comm/inter_node_bytes"] == 3 * per_step and stats["comm/intra_node_bytes"] == 0
        assert per_step == sum(-(-n // 8) for n in shard_numels)  # k - 1 = 1 peer: 1/8 byte per shard element


def test_exact_resume_and_a_clear_error_on_another_mesh_shape(tmp_path):
    ckpt = str(tmp_path)

    def fn(rank, world):
        mesh = _mesh()
        straight, *_ = _train_hsdp(rank, mesh, 6, "hierarchical")
        first, opt, _, _ = _train_hsdp(rank, mesh, 3, "hierarchical")
        save_rank_state(opt, ckpt)
        torch.save({n: p.to_local().clone() for n, p in first.named_parameters()}, f"{ckpt}/model_{rank}.pt")
        # a fresh process's view: new model, optimizer and hook; load this rank's shard and state, go on 3 steps
        model = _sharded(mesh["shard"])
        opt = _optimizer(model.parameters())
        register_birder_fsdp(model, opt, mesh)
        saved = torch.load(f"{ckpt}/model_{rank}.pt", weights_only=True)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.to_local().copy_(saved[n])
        load_rank_state(opt, ckpt)
        for t in range(3, 6):
            _loss(model, rank, t).backward()
            opt.step()
            opt.zero_grad()
        # the same checkpoint on a 1 x 4 mesh (FSDP over all ranks): other shards, refused before anything loads
        other = _sharded(init_device_mesh("cpu", (4,)))
        other_opt = _optimizer(other.parameters())
        with pytest.raises(ValueError) as caught:
            load_rank_state(other_opt, ckpt)
        return _full(straight), _full(model), str(caught.value), len(other_opt.state)

    for straight, resumed, error, loaded in run_distributed(fn, 4):
        assert _equal(straight, resumed)
        assert "same mesh shape" in error and "Nothing was loaded" in error and loaded == 0


def test_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank():
    def fn(rank, world):
        mesh = _mesh()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, opt, hook, _ = _train_hsdp(rank, mesh, 5, "hierarchical", nan_at=2)
        steps = {int(opt.state[p]["step"]) for p in model.parameters()}
        ref = _train_reference(rank, mesh, 5, "hierarchical", skip=(2,))
        return _full(model), ref, hook.skipped_steps, steps, [str(w.message) for w in caught]

    for full, ref, skipped, steps, messages in run_distributed(fn, 4):
        assert skipped == 1 and steps == {4} and any("non-finite" in m for m in messages)
        assert _equal(full, ref)  # rank 3's NaN (node 1, shard 1) skipped every shard on every node


def test_bf16_parameters_keep_fp32_state():
    def fn(rank, world):
        mesh = _mesh()
        model, opt, _, losses = _train_hsdp(rank, mesh, 8, "hierarchical", dtype=torch.bfloat16)
        states = [opt.state[p] for p in model.parameters()]
        dtypes = {(p.dtype, s["exp_avg"].dtype, s["exp_avg_abs"].dtype) for p, s in zip(model.parameters(), states)}
        return _full(model), dtypes, losses

    res = run_distributed(fn, 4)
    for full, dtypes, _ in res:
        assert _equal(full, res[0][0])
        assert dtypes == {(torch.bfloat16, torch.float32, torch.float32)}
    assert res[0][2][-1] < 0.5 * res[0][2][0]


def test_mixed_precision_reduce_in_fp32_of_bf16_compute():
    def fn(rank, world):
        mesh = _mesh()
        model = _model()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for i in LAYERS:
            fully_shard(model[i], mesh=mesh["shard"], mp_policy=policy)
        fully_shard(model, mesh=mesh["shard"], mp_policy=policy)
        opt = _optimizer(model.parameters())
        register_birder_fsdp(model, opt, mesh)
        losses = []
        for t in range(6):
            loss = _loss(model, rank, t)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return _full(model), losses

    res = run_distributed(fn, 4)
    assert all(_equal(full, res[0][0]) for full, _ in res)
    assert res[0][1][-1] < 0.5 * res[0][1][0]


def test_fsdp_over_all_ranks_trains_as_one_worker_with_a_note():
    def fn(rank, world):
        mesh = init_device_mesh("cpu", (4,))
        model = _sharded(mesh)
        opt = _optimizer(model.parameters())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hook = register_birder_fsdp(model, opt, mesh)
        # reference: one worker, no communication, on the gradient averaged over all 4 ranks
        ref = _model()
        ref_opt = _optimizer(ref.parameters())
        for t in range(4):
            _loss(model, rank, t).backward()
            opt.step()
            opt.zero_grad()
            _loss(ref, rank, t).backward()
            for p in ref.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(4)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "distributed without its hook": on purpose here
                ref_opt.step()
            ref_opt.zero_grad()
        return _full(model), [p.detach() for p in ref.parameters()], [str(w.message) for w in caught], hook.stats

    for full, ref, messages, stats in run_distributed(fn, 4):
        assert any("no replicate dimension" in m for m in messages)
        assert stats.total_bytes == 0
        for a, b in zip(full, ref):  # the all-reduce and the reduce-scatter may sum 4 values in another order
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_unsupported_setups_are_refused_with_the_fix():
    def fn(rank, world):
        from torch.nn.parallel import DistributedDataParallel as DDP

        mesh = _mesh()
        errors = {}

        def attempt(key, make):
            try:
                make()
            except (TypeError, ValueError) as e:
                errors[key] = str(e)

        native = _sharded(mesh)  # native 2-D HSDP: (Replicate, Shard(0)) on the 2-D mesh
        attempt("native", lambda: register_birder_fsdp(native, _optimizer(native.parameters()), mesh))
        plain = _model()
        attempt("ddp", lambda: register_birder_fsdp(DDP(plain), _optimizer(plain.parameters()), mesh))
        flat = _sharded(init_device_mesh("cpu", (4,)))
        attempt("wrong_mesh", lambda: register_birder_fsdp(flat, _optimizer(flat.parameters()), mesh))
        good = _sharded(mesh["shard"])
        attempt("adam", lambda: register_birder_fsdp(good, OneBitAdam(good.parameters(), freeze_step=2), mesh))
        attempt("torch_adam", lambda: register_birder_fsdp(good, torch.optim.AdamW(good.parameters()), mesh))
        attempt("partial", lambda: register_birder_fsdp(good, _optimizer(list(good.parameters())[:2]), mesh))
        half = _model()
        fully_shard(half[0], mesh=mesh["shard"])  # the root not wrapped: the other layers are plain tensors
        attempt("unsharded", lambda: register_birder_fsdp(half, _optimizer(half.parameters()), mesh))
        attempt("mesh", lambda: register_birder_fsdp(good, _optimizer(good.parameters()), mesh["shard"]))
        opt = _optimizer(good.parameters())
        register_birder_fsdp(good, opt, mesh)
        attempt("twice", lambda: register_birder_fsdp(good, opt, mesh))
        return errors

    errors = run_distributed(fn, 4)[0]
    assert "native 2-D HSDP" in errors["native"] and "mesh['shard']" in errors["native"]
    assert "attach_ddp_hook" in errors["ddp"]
    assert "sharded over ranks [0, 1, 2, 3]" in errors["wrong_mesh"]
    assert "1-bit Adam on FSDP shards" in errors["adam"]
    assert "needs a birder_hf.Birder" in errors["torch_adam"]
    assert "not in the Birder optimizer" in errors["partial"]
    assert "not sharded by FSDP2" in errors["unsharded"]
    assert "must cover every rank" in errors["mesh"]  # mesh["shard"] instead of the 2-D mesh
    assert "already has" in errors["twice"]


def test_fsdp1_is_refused():
    from torch.distributed.fsdp import FullyShardedDataParallel

    def fn(rank, world):
        model = FullyShardedDataParallel(_model(), device_id=torch.device("cpu"))
        try:
            register_birder_fsdp(model, _optimizer(model.parameters()), _mesh((1, 2)))
        except TypeError as e:
            return str(e)

    assert all("not FSDP1" in msg for msg in run_distributed(fn, 2))


def test_tensor_parallel_is_refused():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def fn(rank, world):
        mesh = _mesh((1, 2))
        errors = []
        mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        one = torch.nn.Sequential(torch.nn.Linear(8, 16))
        for model, plan in ((mlp, {"0": ColwiseParallel(), "2": RowwiseParallel()}), (one, {"0": ColwiseParallel()})):
            parallelize_module(model, mesh["shard"], plan)
            try:
                register_birder_fsdp(model, _optimizer(model.parameters()), mesh)
            except ValueError as e:
                errors.append(str(e))
        return errors

    for rowwise, colwise in run_distributed(fn, 2):
        assert "one Shard(0) placement" in rowwise  # a row-wise layer's weight is Shard(1)
        assert "found no FSDP2 module" in colwise  # column-wise only: Shard(0) everywhere, but no FSDP unit


def test_register_needs_an_initialized_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        register_birder_fsdp(_model(), _optimizer(_model().parameters()), None)


def test_accelerate_loop_with_a_model_sharded_on_the_node(tmp_path):
    ckpt = str(tmp_path / "state")

    def fn(rank, world):
        from accelerate import Accelerator

        from birder_hf.integrations.accelerate import register_birder_hook

        accelerator = Accelerator(cpu=True)
        mesh = _mesh()
        model = _sharded(mesh["shard"])
        opt = accelerator.prepare(_optimizer(model.parameters()))  # accelerate would refuse to DDP-wrap the model
        state = register_birder_hook(accelerator, model, opt, mesh=mesh)
        for t in range(3):
            accelerator.backward(_loss(model, rank, t))
            opt.step()
            opt.zero_grad()
        accelerator.save_state(ckpt)
        return type(state).__name__, _full(model), _train_reference(rank, mesh, 3, "hierarchical")

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}  # read by accelerate; the group already exists
    res = run_distributed(fn, 4, local_world_size=2, env=env)  # with the launcher's environment
    for kind, full, ref in res:
        assert kind == "FSDPHookState" and _equal(full, ref)
    assert sorted(os.listdir(os.path.join(ckpt, "birder"))) == [f"rank_0000{r}-of-00004.pt" for r in range(4)]


# ------------------------------------------------------------------------------------ a parameter no rank used
# step -> the ranks whose forward uses the side layer (a node's ranks run the same FSDP units: FSDP all-gathers a
# unit's parameters inside the node)
SIDE_USERS = {0: (0, 1, 2, 3), 1: (0, 1, 2, 3), 3: (0, 1)}


class _Branchy(torch.nn.Module):
    """``_model()`` plus a ``side`` layer that only some steps (and ranks) use: a branch not taken."""

    def __init__(self):
        super().__init__()
        self.body = _model()
        self.side = torch.nn.Linear(12, 1)

    def forward(self, x, use_side):
        out = self.body(x)
        return out + self.side(x) if use_side else out


def _branchy_loss(model, rank, t):
    x, y = _batch(rank, t)
    return (model(x, rank in SIDE_USERS.get(t, ())) - y).pow(2).mean()


def _branchy_hsdp(rank, mesh, steps, *, in_backward, unused_params=False):
    model = _Branchy()
    for i in LAYERS:
        fully_shard(model.body[i], mesh=mesh["shard"])
    fully_shard(model.side, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    if unused_params:  # what a user sets so that ranks using different layers reduce the same layout
        for m in (model.body[0], model.body[2], model.body[4], model.side, model):
            m.set_reduce_scatter_unused_params(True, recurse=False)
    opt = _optimizer(model.parameters())
    register_birder_fsdp(model, opt, mesh, in_backward=in_backward)
    for t in range(steps):
        _branchy_loss(model, rank, t).backward()
        opt.step()
        opt.zero_grad()
    side_steps = [int(opt.state[p]["step"]) for p in model.side.parameters()]
    return _full(model), side_steps


def _branchy_reference(rank, mesh, steps):
    # unsharded; a rank that did not use the side layer adds zeros to its node's average when some rank used it
    # (what FSDP's reduce-scatter of zeros does), and nobody has a gradient for it when no rank used it
    model = _Branchy()
    opt = _optimizer(model.parameters(), topology=Topology.from_replicate_dim(mesh), method="hierarchical")
    node = mesh["shard"].get_group()
    for t in range(steps):
        _branchy_loss(model, rank, t).backward()
        for p in model.parameters():
            if p.grad is None and t in SIDE_USERS:
                p.grad = torch.zeros_like(p)
            if p.grad is not None:
                dist.all_reduce(p.grad, group=node)
                p.grad.div_(mesh.size(1))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_a_parameter_no_rank_used_is_not_stepped_on_either_fsdp_path():
    # The side layer: used by every rank on steps 0-1, by node 0 only on step 3, by no rank on steps 2, 4, 5. Before
    # the fix the hook path (FSDP hands it zeros) and the step() path with set_reduce_scatter_unused_params moved it
    # by lr * u on every step no rank used it (m and b decay together, u stays), unlike DDP and the reference.
    def fn(rank, world):
        mesh = _mesh()
        return (
            _branchy_reference(rank, mesh, 6),
            _branchy_hsdp(rank, mesh, 6, in_backward=True),
            _branchy_hsdp(rank, mesh, 6, in_backward=False, unused_params=True),
        )

    res = run_distributed(fn, 4, timeout=240)
    for ref, (hooked, hook_side_steps), (stepped, step_side_steps) in res:
        assert _equal(stepped, ref)  # the step() path, FSDP handing over zeros (set_reduce_scatter_unused_params)
        assert _equal(hooked, ref)  # the hook path (it sets set_reduce_scatter_unused_params)
        assert hook_side_steps == step_side_steps == [3, 3]  # steps 0, 1 and 3: m, b untouched on the others
    assert _equal(res[0][1][0], res[3][1][0])


# ------------------------------------------------------------------------------------------- fp16 loss scaling
def _hsdp_fp16(rank, mesh, steps, *, in_backward, scaled, overflow_at=2):
    from accelerate import Accelerator

    from birder_hf.integrations.accelerate import register_birder_hook

    acc = Accelerator(cpu=True)
    if scaled:  # what accelerate builds for mixed_precision="fp16" on an accelerator; grows every 2 clean steps
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    model = _sharded(mesh["shard"])
    opt = acc.prepare(_optimizer(model.parameters()))
    if in_backward:
        register_birder_hook(acc, model, opt, mesh=mesh)  # hands the hook accelerate's scaler
    else:
        register_birder_fsdp(model, opt, mesh, in_backward=False)
    record = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "a rank had a non-finite gradient"
        for t in range(steps):
            loss = _loss(model, rank, t)
            if t == overflow_at and rank == 3:  # node 1's reduce-scatter spreads it to rank 2; node 0 stays finite
                loss = loss * float("inf")
            acc.backward(loss)
            opt.step()
            scale = acc.scaler.get_scale() if scaled else None
            record.append((opt.step_was_skipped, opt.optimizer.step_was_skipped, scale))
            opt.zero_grad()
    state = [{k: opt.optimizer.state[p][k].clone() for k in ("exp_avg", "exp_avg_abs")} for p in model.parameters()]
    return _full(model), record, state


def test_fp16_overflow_on_one_rank_backs_off_every_rank_on_both_fsdp_paths():
    # Before the fix an inf on rank 3 backed off only node 1's scalers ([4096, 4096, 2048, 2048]), accelerate's
    # step_was_skipped stayed False on every rank (the scheduler advanced on a skipped step), and m, b mixed
    # gradients of two scales after a scale change.
    def fn(rank, world):
        mesh = _mesh()
        return {
            (path, scaled): _hsdp_fp16(rank, mesh, 6, in_backward=path == "hook", scaled=scaled)
            for path in ("hook", "step")
            for scaled in (True, False)
        }

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    res = run_distributed(fn, 4, local_world_size=2, env=env, timeout=300)
    skips = [False, False, True, False, False, False]
    for runs in res:
        for path in ("hook", "step"):
            full, record, state = runs[(path, True)]
            plain, plain_record, plain_state = runs[(path, False)]
            assert [r[0] for r in record] == skips, path  # AcceleratedOptimizer.step_was_skipped
            assert [r[1] for r in record] == [r[1] for r in plain_record] == skips, path  # Birder's
            s = 2.0**12  # grown after steps 1 and 4 (2 clean steps each), halved by the overflow: on every rank
            assert [r[2] for r in record] == [s, 2 * s, s, s, 2 * s, 2 * s], path
            assert _equal(full, plain), path  # the scaled run is the unscaled one, bit for bit
            assert all(_equal(list(a.values()), list(b.values())) for a, b in zip(state, plain_state)), path
        assert _equal(runs[("hook", True)][0], runs[("step", True)][0])
    assert all(_equal(r[("hook", True)][0], res[0][("hook", True)][0]) for r in res)
