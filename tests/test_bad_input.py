"""Bad input, one row per case (issue 19): the error type, a message that names the argument and says how to fix it,
and nothing changed (optimizer state, parameters, files). Two-rank cases fail on every rank, with the same message,
within seconds. ``docs/VALIDATION.md`` lists what is validated where.

Each single-process row runs against a fresh ``Env``: a tiny model, a Birder stepped twice (so there is state to
damage), a gradient ready for the next step, and a per-rank checkpoint on disk.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from birder_hf import Birder, BirderHookState, OneBitAdam, Topology, onebit_all_reduce
from birder_hf.checkpoint import load_rank_state, save_rank_state
from birder_hf.preflight import PreflightError
from birder_hf.settings import CommSettings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Env:
    def __init__(self, folder):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.opt = Birder(self.model.parameters(), lr=0.1, weight_decay=0.1, seed=1)
        for _ in range(2):
            self.model(torch.randn(8, 4)).square().mean().backward()
            self.opt.step()
            self.opt.zero_grad()
        self.dir = str(folder)
        save_rank_state(self.opt, self.dir, rank=0, world_size=1)
        self.model(torch.randn(8, 4)).square().mean().backward()  # a step is ready: a failure could half-apply it

    def state_dict(self):
        return copy.deepcopy(self.opt.state_dict())

    def snapshot(self):
        files = {}
        for base, _, names in os.walk(self.dir):
            for name in names:
                with open(os.path.join(base, name), "rb") as f:
                    files[os.path.relpath(os.path.join(base, name), self.dir)] = f.read()
        return (
            [p.detach().clone() for p in self.model.parameters()],
            [p.grad.clone() for p in self.model.parameters()],
            self.state_dict(),
            copy.deepcopy(self.opt.param_groups[0] | {"params": None}),
            files,
        )


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _recipe(name):
    key = f"_recipe_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(ROOT, "recipes", f"{name}.py"))
        sys.modules[key] = importlib.util.module_from_spec(spec)  # dataclasses look their module up there
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


def _resnet_args(*argv):
    from transformers import HfArgumentParser

    return HfArgumentParser(_recipe("resnet50").Args).parse_args_into_dataclasses(args=list(argv))


def _birder_arguments(**kwargs):
    from birder_hf.integrations.transformers import BirderArguments

    return BirderArguments(**kwargs)


def _accelerate_hook(env, **options):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from birder_hf.integrations.accelerate import register_birder_hook

    try:
        acc = Accelerator(cpu=True)
        return register_birder_hook(acc, env.model, env.opt, **options)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _squad(env, text):
    sys.path.insert(0, os.path.join(ROOT, "recipes"))
    from embedded_data import load_squad_json

    path = os.path.join(env.dir, "squad.json")
    with open(path, "w") as f:
        f.write(text)
    env.snapshot_files_again = True
    return load_squad_json(path)


def _recipe_args(name, *argv):
    return _recipe(name).parse_args(list(argv))


def _preflight(*argv):
    from birder_hf.cli import preflight

    return preflight._config(preflight._parser().parse_args(list(argv)), {})


def _resnet_data_dir(env, *folders):
    root = os.path.join(env.dir, "images")
    for folder in folders:
        os.makedirs(os.path.join(root, folder, "class0"), exist_ok=True)
    return _resnet_args("--data_dir", root)


def _birder_trainer(env, **training):
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from birder_hf.integrations.transformers import BirderArguments, BirderTrainer

    args = TrainingArguments(output_dir=os.path.join(env.dir, "out"), use_cpu=True, report_to=[], **training)
    return BirderTrainer(model=env.model, args=args, birder_args=BirderArguments())


def _with_state(env, edit):
    sd = env.state_dict()
    edit(sd)
    return env.opt.load_state_dict(sd)


def _adamw_state(env, cls=Birder, **kwargs):
    twin = copy.deepcopy(env.model)  # AdamW's state of the same model, made on a copy
    adamw = torch.optim.AdamW(twin.parameters(), lr=0.1)
    adamw.step()
    target = env.opt if cls is Birder else cls(env.model.parameters(), **kwargs)
    target.load_state_dict(adamw.state_dict())


def _other_shape(env):
    model = torch.nn.Linear(4, 5)
    opt = Birder(model.parameters(), seed=1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    env.opt.load_state_dict(opt.state_dict())


def _param(dtype=torch.float32):
    p = torch.zeros(3, dtype=dtype)
    return torch.nn.Parameter(p) if dtype.is_floating_point or dtype.is_complex else p


P = pytest.param
ROWS = [
    # ------------------------------------------------------------- silent wrong numbers, now errors at set-up
    P(lambda e: Birder([_param()], lr=float("nan")), ValueError, ["lr=nan", "finite float >= 0"], id="lr-nan"),
    P(lambda e: Birder([_param()], lr=float("inf")), ValueError, ["lr=inf", "finite float >= 0"], id="lr-inf"),
    P(lambda e: Birder([_param()], lr=True), ValueError, ["lr=True", "finite float >= 0"], id="lr-bool"),
    P(lambda e: Birder([_param()], weight_decay=float("nan")), ValueError, ["weight_decay=nan", ">= 0"], id="wd-nan"),
    P(lambda e: Birder([_param()], seed=1.7), ValueError, ["seed=1.7", "must be an int"], id="seed-float"),
    P(lambda e: Birder([_param()], seed="7"), ValueError, ["seed='7'", "must be an int"], id="seed-str"),
    P(lambda e: Birder([_param()], seed="abc"), ValueError, ["seed='abc'", "must be an int"], id="seed-abc"),
    P(
        lambda e: e.opt.add_param_group({"params": [_param()], "lr": float("nan")}),
        ValueError,
        ["lr=nan", "param group 1", "finite float >= 0"],
        id="add-param-group-nan",
    ),
    P(
        lambda e: OneBitAdam([_param()], lr=float("nan"), freeze_step=1),
        ValueError,
        ["lr=nan", "finite float >= 0"],
        id="onebitadam-lr-nan",
    ),
    P(
        lambda e: Birder([_param()], lr=torch.tensor([0.1, 0.2])),
        ValueError,
        ["Tensor lr must be 1-element"],
        id="lr-tensor-2",
    ),
    P(lambda e: Birder([_param()], foreach="yes"), ValueError, ["foreach='yes'", "None, True or False"], id="flag"),
    P(lambda e: Birder([_param()], differentiable=True), ValueError, ["differentiable", "leave it False"], id="diff"),
    P(
        lambda e: _with_state(e, lambda sd: sd["state"][0]["exp_avg"].__setitem__((0, 0), float("nan"))),
        ValueError,
        ["NaN or inf in exp_avg", "nothing was loaded", "state_dict() wrote"],
        id="load-nan-exp-avg",
    ),
    P(
        lambda e: _with_state(e, lambda sd: sd["state"][1]["exp_avg_abs"].__setitem__(0, float("inf"))),
        ValueError,
        ["NaN or inf in exp_avg_abs", "nothing was loaded"],
        id="load-inf-exp-avg-abs",
    ),
    P(
        lambda e: _with_state(e, lambda sd: sd["state"][1]["exp_avg"].__setitem__(0, 5.0)),
        ValueError,
        ["|exp_avg| <= exp_avg_abs", "nothing was loaded"],
        id="load-m-above-b",
    ),
    P(
        lambda e: Birder([e.model.weight, e.model.weight]),
        ValueError,
        ["appears twice", "Pass each parameter once"],
        id="duplicate-param",
    ),
    P(
        lambda e: _timm("adamw"),
        ValueError,
        ["'adamw'", "replace timm's own", "Pick a free name"],
        id="timm-adamw",
    ),
    P(lambda e: _timm(""), ValueError, ["name=''", "non-empty string"], id="timm-empty"),
    P(
        lambda e: save_rank_state(e.model, e.dir, rank=0, world_size=1),
        TypeError,
        ["Birder or OneBitAdam optimizer", "Linear", "pass the optimizer"],
        id="save-a-model",
    ),
    P(
        lambda e: save_rank_state(e.opt, e.dir, rank=-1, world_size=2),
        ValueError,
        ["rank=-1", "[0, world_size)", "process_index"],
        id="save-rank-negative",
    ),
    P(
        lambda e: save_rank_state(e.opt, e.dir, rank=2, world_size=2),
        ValueError,
        ["rank=2", "[0, world_size)"],
        id="save-rank-past-world",
    ),
    P(
        lambda e: _birder_arguments(inter_method="bogus"),
        ValueError,
        ["inter_method 'bogus'", "allgather, scatter_gather"],
        id="args-inter-method",
    ),
    P(
        lambda e: _accelerate_hook(e, method="bogus"),
        ValueError,
        ["method 'bogus'", "allgather, scatter_gather, hierarchical"],
        id="register-hook-method-one-process",
    ),
    P(
        lambda e: _accelerate_hook(e, chunk_numel=0),
        ValueError,
        ["chunk_numel=0", "int >= 1"],
        id="register-hook-chunk-one-process",
    ),
    # ---------------------------------------------------------- errors that came after state was partly written
    P(_other_shape, ValueError, ["exp_avg of shape (5, 4)", "another model"], id="load-other-shape"),
    P(
        lambda e: _adamw_state(e),
        ValueError,
        ["torch.optim.Adam/AdamW", "load only the model's weights"],
        id="load-adamw-state",
    ),
    P(
        lambda e: _with_state(e, lambda sd: sd["state"][0].pop("exp_avg_abs")),
        ValueError,
        ["lacks ['exp_avg_abs']", "nothing was loaded"],
        id="load-missing-exp-avg-abs",
    ),
    P(
        lambda e: _with_state(e, lambda sd: sd["param_groups"][0].pop("seed")),
        ValueError,
        ["lacks Birder's settings ['seed']", "load_rank_state"],
        id="load-missing-seed",
    ),
    P(
        lambda e: _with_state(e, lambda sd: sd["state"][0].__setitem__("step", torch.tensor(1.5))),
        ValueError,
        ["step=1.5", "whole number"],
        id="load-fractional-step",
    ),
    P(
        lambda e: _with_state(e, lambda sd: sd["param_groups"][0].__setitem__("beta", 1.5)),
        ValueError,
        ["beta=1.5", "param group 0 of the state dict", "[0, 1)"],
        id="load-bad-beta",
    ),
    P(
        lambda e: Birder([_param(torch.complex64)]),
        TypeError,
        ["complex64", "torch.view_as_real"],
        id="complex-param",
    ),
    P(
        lambda e: BirderHookState(e.opt, inter_method="bogus"),
        ValueError,
        ["inter_method 'bogus'", "allgather, scatter_gather"],
        id="hook-inter-method",
    ),
    P(lambda e: BirderHookState(e.opt, topology="flat"), TypeError, ["topology", "Topology"], id="hook-topology"),
    P(
        lambda e: BirderHookState(e.opt, chunk_numel="abc"),
        ValueError,
        ["chunk_numel='abc'", "int >= 1"],
        id="hook-chunk-numel",
    ),
    # ------------------------------------------------------------------------ late failures, unclear errors
    P(
        lambda e: _resnet_args("--method", "bogus"),
        ValueError,
        ["method 'bogus'", "allgather, scatter_gather, hierarchical"],
        id="resnet-method",
    ),
    P(lambda e: _resnet_args("--epochs", "0"), ValueError, ["--epochs must be >= 1"], id="resnet-epochs-0"),
    P(lambda e: _resnet_args("--num_nodes", "0"), ValueError, ["--num_nodes must be >= 1"], id="resnet-nodes-0"),
    P(
        lambda e: _squad(e, '{"data": [}'),
        ValueError,
        ["squad.json is not valid JSON", "SQuAD v1.1 format"],
        id="squad-malformed",
    ),
    P(
        lambda e: _squad(e, '{"version": "1.1"}'),
        ValueError,
        ["squad.json has no 'data' list", "SQuAD v1.1 format"],
        id="squad-no-data",
    ),
    P(
        lambda e: _birder_arguments(num_nodes=0),
        ValueError,
        ["num_nodes=0", "int >= 1"],
        id="args-num-nodes-0",
    ),
    P(
        lambda e: Birder([_param(torch.int64)]),
        TypeError,
        ["torch.int64", "model.parameters()"],
        id="int64-param",
    ),
    P(
        lambda e: onebit_all_reduce(torch.zeros(8), chunk_numel="abc"),
        ValueError,
        ["chunk_numel='abc'", "int >= 1"],
        id="allreduce-chunk-numel",
    ),
    P(
        lambda e: onebit_all_reduce(torch.zeros(8), method=CommSettings("allgather"), chunk_numel=16),
        TypeError,
        ["inside the CommSettings"],
        id="allreduce-settings-object-and-strings",
    ),
    P(
        lambda e: CommSettings(method="Hierarchical"),
        ValueError,
        ["unknown method 'Hierarchical'", "valid methods"],
        id="settings-object-method",
    ),
    P(
        lambda e: Birder([_param()], topology="flat"),
        TypeError,
        ["topology", "birder_hf.Topology"],
        id="birder-topology-str",
    ),
    P(
        lambda e: _birder_arguments(beta="0.9"),
        ValueError,
        ["beta='0.9'", "float in [0, 1)"],
        id="args-beta-str",
    ),
    P(
        lambda e: _birder_arguments(beta2=1.0),
        ValueError,
        ["beta2=1.0", "None or a float in [0, 1)"],
        id="args-beta2-one",
    ),
    P(
        lambda e: Birder([_param()], grad_clip=-1.0),
        ValueError,
        ["grad_clip=-1.0", "None or a finite float > 0"],
        id="birder-grad-clip-negative",
    ),
    P(
        lambda e: _adamw_state(e, OneBitAdam, freeze_step=2),
        ValueError,
        ["torch.optim.Adam/AdamW", "OneBitAdam", "load only the model's weights"],
        id="onebitadam-adamw-state",
    ),
    P(
        lambda e: load_rank_state(e.opt, e.dir, rank=3, world_size=2),
        ValueError,
        ["rank=3", "[0, world_size)"],
        id="load-rank-past-world",
    ),
    # issue 24: an optim the Trainer would have ignored
    P(
        lambda e: _birder_trainer(e, optim="adafactor"),
        ValueError,
        ["TrainingArguments.optim='adafactor'", "BirderTrainer trains with Birder", "Leave --optim at its default"],
        id="trainer-optim-adafactor",
    ),
    P(
        lambda e: _birder_trainer(e, optim="sgd"),
        ValueError,
        ["TrainingArguments.optim='sgd'", "would ignore it"],
        id="trainer-optim-sgd",
    ),
    # issue 24: recipe and preflight flags checked at parse time, the flag named (they trained and failed before
    # saving, were read as "no limit" or as the default, or were reported as a network failure)
    P(
        lambda e: _recipe_args("causal_lm", "--max_eval_blocks", "0"),
        ValueError,
        ["--max_eval_blocks must be >= 1", "got 0"],
        id="causal-lm-max-eval-blocks-0",
    ),
    P(
        lambda e: _recipe_args("causal_lm", "--max_files", "0"),
        ValueError,
        ["--max_files must be >= 1"],
        id="causal-lm-max-files-0",
    ),
    P(
        lambda e: _recipe_args("causal_lm", "--validation_percent", "0"),
        ValueError,
        ["--validation_percent must lie in 1..99"],
        id="causal-lm-validation-percent-0",
    ),
    P(
        lambda e: _recipe_args("bert_base", "--max_train_samples", "0"),
        ValueError,
        ["--max_train_samples must be >= 1", "got 0"],
        id="bert-max-train-samples-0",
    ),
    P(
        lambda e: _recipe_args("bert_base", "--max_eval_samples", "0"),
        ValueError,
        ["--max_eval_samples must be >= 1"],
        id="bert-max-eval-samples-0",
    ),
    P(
        lambda e: _recipe_args("bert_base", "--embedded_num_eval", "0"),
        ValueError,
        ["--embedded_num_eval must be >= 1"],
        id="bert-embedded-num-eval-0",
    ),
    P(
        lambda e: _resnet_args("--warmup_epochs", "nan"),
        ValueError,
        ["--warmup_epochs must be a finite number >= 0, got nan"],
        id="resnet-warmup-nan",
    ),
    P(
        lambda e: _resnet_args("--warmup_epochs", "inf"),
        ValueError,
        ["--warmup_epochs must be a finite number >= 0, got inf"],
        id="resnet-warmup-inf",
    ),
    P(lambda e: _resnet_args("--image_size", "0"), ValueError, ["--image_size must be >= 1"], id="resnet-image-0"),
    P(lambda e: _resnet_args("--lr", "nan"), ValueError, ["--lr must be a finite number >= 0"], id="resnet-lr-nan"),
    P(lambda e: _resnet_args("--beta", "1.0"), ValueError, ["--beta must be in [0, 1)"], id="resnet-beta-1"),
    P(
        lambda e: _resnet_data_dir(e, "train"),
        ValueError,
        ["has no val/ folder", "train/<class>/ and val/<class>/"],
        id="resnet-data-dir-without-val",
    ),
    P(
        lambda e: _preflight("--nnodes", "0", "--num_processes", "2"),
        PreflightError,
        ["--nnodes 0 must be at least 1"],
        id="preflight-nnodes-0",
    ),
    P(
        lambda e: _preflight("--timeout", "nan"),
        PreflightError,
        ["--timeout nan must be a finite number > 0"],
        id="preflight-timeout-nan",
    ),
    P(
        lambda e: _preflight("--timeout", "inf"),
        PreflightError,
        ["--timeout inf must be a finite number > 0"],
        id="preflight-timeout-inf",
    ),
    P(
        lambda e: _preflight("--size_mb", "nan"),
        PreflightError,
        ["--size_mb nan must be a finite number > 0"],
        id="preflight-size-mb-nan",
    ),
    # ------------------------------------------ issue 24: settings changed after construction, checked at step()
    P(lambda e: _changed(e, "beta", 2.0), ValueError, ["beta=2.0", "at step()", "[0, 1)"], id="step-beta-2"),
    P(
        lambda e: _changed(e, "lr", torch.tensor(float("nan"))),
        ValueError,
        ["lr=tensor(nan)", "at step()"],
        id="step-tensor-lr-nan",
    ),
    P(
        lambda e: _changed(e, "lr", float("nan")),  # what a scheduler returning NaN writes
        ValueError,
        ["lr=nan", "param group 0", "at step()"],
        id="step-scheduler-lr-nan",
    ),
    P(lambda e: _changed(e, "weight_decay", -0.1), ValueError, ["weight_decay=-0.1"], id="step-wd-negative"),
    # ------------------------------------- issue 24: a wrong-shape gradient: nothing stepped, nothing written
    P(
        lambda e: _wrong_shape_grad(e, OneBitAdam, freeze_step=2),
        RuntimeError,
        ["gradient of shape (3,)", "nothing was stepped"],
        id="onebitadam-wrong-shape-grad",
    ),
    P(
        lambda e: _wrong_shape_grad(e, Birder, seed=0),
        RuntimeError,
        ["gradient of shape (3,)", "nothing was stepped"],
        id="birder-wrong-shape-grad",
    ),
    P(
        lambda e: _resized_after_state(e, OneBitAdam, freeze_step=1),
        RuntimeError,
        ["state of shape (3,)", "before creating the optimizer"],
        id="onebitadam-resized-param",
    ),
    # ------------------------------------------------------------ issue 24: coerced or ignored settings
    P(
        lambda e: BirderHookState(e.opt, check_finite=None),
        ValueError,
        ["check_finite=None", "True or False"],
        id="hook-check-finite-none",
    ),
    P(
        lambda e: BirderHookState(e.opt, check_finite="no"),
        ValueError,
        ["check_finite='no'", "True or False"],
        id="hook-check-finite-no",
    ),
    P(
        lambda e: OneBitAdam([_param()], freeze_step=1, bias_correction="no"),
        ValueError,
        ["bias_correction='no'", "True or False"],
        id="onebitadam-bias-correction-str",
    ),
    P(
        lambda e: e.opt.add_param_group({"params": [_param()], "seed": 7}),
        ValueError,
        ["seed=7", "param group 1", "one seed"],
        id="group-seed",
    ),
    P(
        lambda e: Birder([{"params": [_param()], "seed": 5}], seed=1),
        ValueError,
        ["seed=5", "one seed", "pass seed= to Birder"],
        id="constructor-group-seed",
    ),
    P(
        lambda e: e.opt.add_param_group({"params": [_param()], "weight_decy": 0.1}),
        ValueError,
        ["'weight_decy'", "param group 1", "did you mean 'weight_decay'"],
        id="group-key-typo",
    ),
    P(
        lambda e: Birder([{"params": [_param()], "betas": (0.9, 0.99)}]),
        ValueError,
        ["'betas'", "did you mean 'beta'"],
        id="group-key-betas",
    ),
    P(
        lambda e: OneBitAdam([{"params": [_param()], "momentum": 0.9}], freeze_step=1),
        ValueError,
        ["'momentum'", "OneBitAdam's settings are"],
        id="onebitadam-group-key-momentum",
    ),
    P(
        lambda e: Birder([_param()], betas=(0.9, 0.999)),
        TypeError,
        ["betas=(0.9, 0.999)", "pass beta="],
        id="birder-betas",
    ),
    P(
        lambda e: _step_without(e, "stale"),
        ValueError,
        ["lacks Birder's settings ['stale']", "set them back"],
        id="step-with-a-setting-deleted",
    ),
    P(
        lambda e: e.opt.load_state_dict(_onebitadam_state(e.model)),
        ValueError,
        ["looks like the state of birder_hf.OneBitAdam, not of Birder", "start from zero state"],
        id="load-onebitadam-state-into-birder",
    ),
    # timm's factory drops the common eps=/betas= for Birder (its convention: test_integrations); a typo still raises
    P(lambda e: _timm_create(bta=0.9), TypeError, ["unknown setting bta=0.9", "its settings are"], id="timm-typo"),
    P(
        lambda e: Topology(3, 2, 0, 2, 0, 1, None, None, None, (), ()),
        ValueError,
        ["rank=3", "[0, world_size=2)", "Topology.from_env()"],
        id="topology-rank-past-world",
    ),
    P(
        lambda e: Topology(0, 2, 0, 0, 0, 1, None, None, None, (), ()),
        ValueError,
        ["local_world_size must be an int >= 1, got 0"],
        id="topology-zero-ranks",
    ),
    P(
        lambda e: _with_state(e, lambda sd: sd.__setitem__("state", {str(k): v for k, v in sd["state"].items()})),
        ValueError,
        ["under keys ['0', '1']", "none of its param groups lists", "nothing was loaded"],
        id="load-state-keys-mismatch",
    ),
]


def _changed(env, key, value):
    # a setting changed after construction, then step(); the old value is put back (the table checks nothing else
    # changed)
    old = env.opt.param_groups[0][key]
    env.opt.param_groups[0][key] = value
    try:
        env.opt.step()
    finally:
        env.opt.param_groups[0][key] = old


def _wrong_shape_grad(env, cls, **kwargs):
    # the model's weight (with a gradient ready) and a parameter resized after its backward, in one optimizer
    odd = torch.nn.Parameter(torch.zeros(3))
    odd.grad = torch.ones(3)
    odd.data = torch.zeros(5)
    opt = cls([env.model.weight, odd], lr=0.1, **kwargs)
    opt.step()


def _resized_after_state(env, cls, **kwargs):
    # a parameter resized after its state was made, next to one that is fine: the error comes before either moves
    q, p = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.zeros(3))
    opt = cls([q, p], lr=0.1, **kwargs)
    q.grad, p.grad = torch.ones(4), torch.ones(3)
    opt.step()
    before = (q.detach().clone(), copy.deepcopy(opt.state_dict()))
    p.data, p.grad = torch.zeros(5), torch.ones(5)
    try:
        opt.step()
    finally:
        assert torch.equal(q, before[0]) and _same(opt.state_dict(), before[1]), "a parameter moved before the error"


def _step_without(e, key):
    saved = e.opt.param_groups[0].pop(key)
    try:
        e.opt.step()
    finally:
        e.opt.param_groups[0][key] = saved  # the row's check then compares the state as it was


def _onebitadam_state(model):
    model = copy.deepcopy(model)  # the same parameters, stepped elsewhere
    opt = OneBitAdam(model.parameters(), lr=0.1, freeze_step=2)
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()
    return opt.state_dict()


def _timm_create(**kwargs):
    timm = pytest.importorskip("timm")
    from birder_hf.integrations.timm import register_with_timm

    register_with_timm()
    timm.optim.create_optimizer_v2(torch.nn.Linear(2, 2), "birder", lr=1e-3, **kwargs)


def _timm(name):
    pytest.importorskip("timm")
    from birder_hf.integrations.timm import register_with_timm

    register_with_timm(name)


@pytest.mark.parametrize("call, error, says", ROWS)
def test_bad_input_is_refused_and_changes_nothing(tmp_path, call, error, says):
    env = Env(tmp_path)
    before = env.snapshot()
    with pytest.raises(error) as info:
        call(env)
    message = str(info.value)
    for needle in says:
        assert needle in message, f"{needle!r} not in {message!r}"
    after = env.snapshot()
    if getattr(env, "snapshot_files_again", False):  # the row wrote its own (bad) input file
        after[-1].pop("squad.json")
    assert _same(before, after)
    env.opt.step()  # and the optimizer still works


def test_timm_keeps_its_own_adamw():
    timm = pytest.importorskip("timm")
    with pytest.raises(ValueError):
        _timm("AdamW")
    opt = timm.optim.create_optimizer_v2(torch.nn.Linear(2, 2), "adamw", lr=1e-3)
    assert type(opt) is torch.optim.AdamW


# --------------------------------------------------------------------- what used to be wrong, now correct
def test_what_used_to_fail_now_works(tmp_path):
    env = Env(tmp_path)
    # a zero-size parameter steps (no error, its counter moves like the others')
    z = torch.nn.Parameter(torch.zeros(0, 3))
    opt = Birder([z, torch.nn.Parameter(torch.ones(2))], lr=0.1)
    z.grad = torch.zeros(0, 3)
    opt.param_groups[0]["params"][1].grad = torch.ones(2)
    opt.step()
    assert int(opt.state[z]["step"]) == 1
    # an older state dict without the flag settings loads and steps (filled from this optimizer's defaults)
    sd = env.state_dict()
    for key in ("foreach", "maximize"):
        del sd["param_groups"][0][key]
    env.opt.load_state_dict(sd)
    assert env.opt.param_groups[0]["maximize"] is False and env.opt.param_groups[0]["foreach"] is None
    # a plain-number step (torch.optim accepts one) becomes a tensor again
    sd = env.state_dict()
    sd["state"][0]["step"] = 2
    env.opt.load_state_dict(sd)
    assert torch.is_tensor(env.opt.state[env.model.weight]["step"])
    env.opt.step()
    assert int(env.opt.state[env.model.weight]["step"]) == 3


def test_birder_trainer_leaves_the_callers_training_arguments_alone(tmp_path):
    # issue 24: BirderTrainer set the caller's own max_grad_norm to 0, so a baseline Trainer reusing the object
    # trained without clipping; now the Trainer works on a copy
    transformers = pytest.importorskip("transformers")
    from birder_hf.integrations.transformers import BirderTrainer

    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_grad_norm=1.0)
    before = copy.deepcopy(args.to_dict())
    trainer = BirderTrainer(model=torch.nn.Linear(4, 3), args=args)
    assert trainer.args.max_grad_norm == 0.0  # Birder's own Trainer does not clip d
    assert args.max_grad_norm == 1.0 and args.to_dict() == before  # the caller's object is unchanged
    baseline = transformers.Trainer(model=torch.nn.Linear(4, 3), args=args)
    assert baseline.args.max_grad_norm == 1.0  # a baseline reusing it clips as asked
    positional = BirderTrainer(torch.nn.Linear(4, 3), args)  # args given positionally: copied too
    assert positional.args is not args and positional.args.max_grad_norm == 0.0 and args.max_grad_norm == 1.0


def test_a_parameter_changed_after_its_state_was_made_fails_before_anything_is_written(tmp_path):
    env = Env(tmp_path)
    before = env.snapshot()
    with torch.no_grad():
        env.model.bias.data = torch.zeros(5)  # resized behind the optimizer's back
    env.model.bias.grad = torch.zeros(5)
    with pytest.raises(RuntimeError, match=r"shape \(5,\) .* state of shape \(3,\).*before creating the optimizer"):
        env.opt.step()
    assert _same(before[2], env.state_dict())  # the weight's state was not advanced either
    assert torch.equal(before[0][0], env.model.weight)


# --------------------------------------------------------------------------------------- two ranks
def _every_rank(fn):
    """Run ``fn(rank)`` on two ranks: each returns (error type, message, seconds, unchanged?)."""

    def run(rank, world):
        start = time.monotonic()
        try:
            unchanged = fn(rank)
            return None, "", time.monotonic() - start, unchanged
        except Exception as exc:
            return type(exc).__name__, str(exc), time.monotonic() - start, getattr(exc, "_unchanged", None)

    return run


def _step_with_method(rank):
    p = torch.nn.Parameter(torch.ones(4))
    opt = Birder([p], lr=0.1, seed=0, process_group=dist.group.WORLD, method="allgather" if rank else "scatter_gather")
    p.grad = torch.ones(4)
    try:
        opt.step()
    except Exception as exc:
        exc._unchanged = len(opt.state) == 0 and torch.equal(p.detach(), torch.ones(4))
        raise


def _hook_with_lr(rank):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    BirderHookState(Birder(model.parameters(), lr=0.1 * (rank + 1)))


def _bad_process_group_method(rank):
    Birder([_param()], process_group=dist.group.WORLD, method="bogus")


def _ddp_hook_with_method(rank):
    from birder_hf.hook import attach_ddp_hook

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    attach_ddp_hook(model, Birder(model.parameters(), lr=0.1), method="Hierarchical" if rank == 0 else "hierarchical")


def _accelerate_hook_with_method(rank):
    from accelerate import Accelerator

    from birder_hf.integrations.accelerate import register_birder_hook

    acc = Accelerator(cpu=True)
    assert acc.num_processes == 2, acc.num_processes
    model = torch.nn.Linear(2, 2)
    model, opt = acc.prepare(model, Birder(model.parameters(), lr=0.1))
    register_birder_hook(acc, model, opt, method="hierarchical" if rank == 0 else "Hierarchical")


def _hook_with_quantize(rank):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    BirderHookState(Birder(model.parameters(), lr=0.1, quantize=rank != 0))


def _process_group_birder(rank, shape=(3,), **settings):
    p = torch.nn.Parameter(torch.ones(shape))
    opt = Birder([p], seed=0, process_group=dist.group.WORLD, **settings)
    p.grad = torch.ones(shape)
    opt.step()


def _setting_changed_on_one_rank(rank, path, key="lr"):
    # issue 41: settings were agreed at set-up only; an lr changed on one rank later let the replicas drift apart
    torch.manual_seed(rank)  # each rank its own data
    model = torch.nn.Linear(3, 2)
    torch.nn.init.ones_(model.weight)
    if path == "ddp-hook":
        from birder_hf.hook import attach_ddp_hook

        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = Birder(model.parameters(), lr=0.1, seed=0)
        attach_ddp_hook(model, opt)
    else:
        opt = Birder(model.parameters(), lr=0.1, seed=0, process_group=dist.group.WORLD)

    def step():
        opt.zero_grad()
        model(torch.randn(4, 3)).square().sum().backward()
        opt.step()

    step()
    if rank == 1:
        opt.param_groups[0][key] = 0.2
    before = [p.detach().clone() for p in model.parameters()]
    steps = [int(s["step"]) for s in opt.state.values()]
    try:
        step()
    except RuntimeError as exc:
        exc._unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        exc._unchanged &= steps == [int(s["step"]) for s in opt.state.values()]
        opt.param_groups[0][key] = 0.1 if key == "lr" else 0.0
        step()  # the refused step left nothing behind: the ranks go on together
        raise


class _UnusedLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.used(x)


def _ddp_with_an_unused_layer(rank):
    # issue 41: the error blamed the optimizer's parameter list; DDP held back the bucket of the unused layer
    from birder_hf.hook import attach_ddp_hook

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_UnusedLayer(), find_unused_parameters=False)
    opt = Birder(model.parameters(), lr=0.1)
    attach_ddp_hook(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 3)).sum().backward()
    try:
        opt.step()
    except RuntimeError as exc:
        exc._unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not opt.state
        raise


def _process_group_warnings(rank, world, wrapped):
    torch.manual_seed(rank)  # each rank its own data
    model = torch.nn.Linear(3, 2)
    torch.nn.init.ones_(model.weight)
    opt = Birder(model.parameters(), lr=0.1, seed=0, process_group=dist.group.WORLD)
    net = torch.nn.parallel.DistributedDataParallel(model) if wrapped else model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.zero_grad()
            net(torch.randn(4, 3)).square().sum().backward()
            opt.step()
    return [str(w.message) for w in caught if "same gradients on every rank" in str(w.message)]


def test_birder_with_a_process_group_on_a_ddp_model_without_the_hook_is_named_once():
    # issue 41: DDP all-reduced the gradients in fp32 and step() exchanged them again at 1 bit, without a word
    for said in run_distributed(_process_group_warnings, 2, True, timeout=60):
        assert len(said) == 1 and "a DDP model without the Birder hook?" in said[0], said
        assert "register the hook (attach_ddp_hook, register_birder_hook or BirderTrainer)" in said[0]
    assert run_distributed(_process_group_warnings, 2, False, timeout=60) == [[], []]  # its own gradients: silent


TWO_RANKS = [
    P(
        lambda r: onebit_all_reduce(torch.zeros(8 if r == 0 else 64), topology=Topology.flat(), method="allgather"),
        "ValueError",
        ["numel: rank 0 8, rank 1 64", "same number of elements"],
        id="numel-8-vs-64",
    ),
    P(
        lambda r: onebit_all_reduce(torch.zeros(8 if r else 64), topology=Topology.flat(), method="scatter_gather"),
        "ValueError",
        ["numel: rank 0 64, rank 1 8", "same number of elements"],
        id="numel-scatter-gather",
    ),
    P(
        lambda r: onebit_all_reduce(
            torch.zeros(64), topology=Topology.flat(), method="allgather" if r == 0 else "scatter_gather"
        ),
        "ValueError",
        ["method: rank 0 allgather, rank 1 scatter_gather", "the same method"],
        id="allgather-vs-scatter-gather",
    ),
    P(
        lambda r: onebit_all_reduce(torch.zeros(0 if r == 0 else 8), topology=Topology.flat()),
        "ValueError",
        ["numel: rank 0 0, rank 1 8"],
        id="empty-vs-8",
    ),
    P(
        lambda r: onebit_all_reduce(torch.zeros(64, dtype=torch.float64 if r else torch.float32)),
        "ValueError",
        ["dtype: rank 0 float32, rank 1 float64"],
        id="dtype",
    ),
    P(
        lambda r: Topology.from_layout(2 if r == 0 else 1, 1 if r == 0 else 2),
        "ValueError",
        ["different layouts", "rank 0 (2, 1), rank 1 (1, 2)", "same arguments"],
        id="from-layout-different",
    ),
    P(
        lambda r: Topology.from_layout("a" if r == 0 else 1, 2),
        "ValueError",
        ["num_nodes must be an int >= 1, got 'a'"],
        id="from-layout-str-on-one-rank",
    ),
    P(
        _step_with_method,
        "ValueError",
        ["method: rank 0 scatter_gather, rank 1 allgather"],
        id="optimizer-side-method-differs",
    ),
    P(
        _ddp_with_an_unused_layer,
        "RuntimeError",
        ["2 parameter(s) had no gradient", "pass find_unused_parameters=True", "Nothing was applied"],
        id="ddp-unused-layer-without-find-unused-parameters",
    ),
    P(_hook_with_lr, "ValueError", ["param group 0 lr: rank 0 0.1, rank 1 0.2", "same"], id="hook-lr-differs"),
    P(
        lambda r: _setting_changed_on_one_rank(r, "ddp-hook"),
        "RuntimeError",
        ["param group 0's lr differs across the ranks (from 0.1 to 0.2)", "drift apart", "nothing was applied"],
        id="ddp-hook-lr-changed-on-one-rank-after-set-up",
    ),
    P(
        lambda r: _setting_changed_on_one_rank(r, "process-group", "weight_decay"),
        "RuntimeError",
        ["param group 0's weight_decay differs across the ranks (from 0.0 to 0.2)", "on every rank alike"],
        id="process-group-weight-decay-changed-on-one-rank-after-set-up",
    ),
    P(
        _bad_process_group_method,
        "ValueError",
        ["method 'bogus'", "valid methods"],
        id="process-group-comm-method-bogus",
    ),
    P(
        lambda r: Topology.from_device_mesh(None),
        "TypeError",
        ["DeviceMesh", "init_device_mesh"],
        id="from-device-mesh-none",
    ),
    # issue 24: the optimizer-side all-reduce agrees on its settings as the hooks do (they used to drift apart), and
    # a bad value on one rank stops every rank (the others used to wait until the process-group timeout)
    P(
        lambda r: _process_group_birder(r, lr=float("nan") if r == 0 else 0.1),
        "ValueError",
        ["rank 0: Invalid learning rate lr=nan", "finite float >= 0"],
        id="process-group-lr-nan-on-one-rank",
    ),
    P(
        lambda r: _process_group_birder(r, lr=0.1 * (r + 1)),
        "ValueError",
        ["Birder(process_group=...)", "param group 0 lr: rank 0 0.1, rank 1 0.2", "same parameters and settings"],
        id="process-group-lr-differs",
    ),
    P(
        lambda r: _process_group_birder(r, weight_decay=0.1 * r, beta=0.9 + 0.05 * r, maximize=r == 1),
        "ValueError",
        [
            "weight_decay: rank 0 0.0, rank 1 0.1",
            "beta: rank 0 0.9, rank 1 0.95",
            "maximize: rank 0 False, rank 1 True",
        ],
        id="process-group-settings-differ",
    ),
    P(
        lambda r: _process_group_birder(r, shape=(3,) if r == 0 else (4,)),
        "ValueError",
        ["parameters: rank 0 [(3,)], rank 1 [(4,)]"],
        id="process-group-shapes-differ",
    ),
    P(
        lambda r: Birder([_param()], lr=float("nan") if r else 0.1, topology=Topology.flat()),
        "ValueError",
        ["rank 1: Invalid learning rate lr=nan"],
        id="topology-lr-nan-on-one-rank",
    ),
    P(
        _ddp_hook_with_method,
        "ValueError",
        ["rank 0: unknown method 'Hierarchical'", "valid methods"],
        id="attach-ddp-hook-method-on-one-rank",
    ),
    P(
        _hook_with_quantize,
        "ValueError",
        ["rank 0: quantize=False is for one process only"],
        id="hook-quantize-false-on-one-rank",
    ),
]


@pytest.mark.parametrize("fn, error, says", TWO_RANKS)
def test_two_ranks_fail_together_within_seconds(fn, error, says):
    results = run_distributed(_every_rank(fn), 2, timeout=60)
    assert results[0][1] == results[1][1], results  # the same message on every rank
    for kind, message, seconds, unchanged in results:
        assert kind == error, (kind, message)
        assert seconds < 10, seconds
        assert unchanged in (None, True)
        for needle in says:
            assert needle in message, f"{needle!r} not in {message!r}"


def test_register_birder_hook_with_a_bad_method_on_one_rank_stops_every_rank():
    # issue 24: launched as accelerate launches (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE set, so the Accelerator sees 2
    # processes); rank 1's bad method used to leave rank 0 waiting in Topology.from_env's collective
    results = run_distributed(_every_rank(_accelerate_hook_with_method), 2, local_world_size=2, timeout=60)
    assert results[0][1] == results[1][1], results
    for kind, message, seconds, _ in results:
        assert kind == "ValueError" and seconds < 10, (kind, message, seconds)
        assert "rank 1: unknown method 'Hierarchical'" in message and "valid methods" in message, message


def _outside_the_group(rank, world):
    sub = dist.new_group([0])  # rank 1 gets torch's non-member marker
    try:
        Birder([_param()], process_group=sub)
        return None
    except Exception as exc:
        return type(exc).__name__, str(exc)


def test_a_rank_outside_the_process_group_is_told_so():
    inside, outside = run_distributed(_outside_the_group, 2, timeout=60)
    assert inside is None  # rank 0 alone: nothing to agree with, nobody waits
    assert outside[0] == "ValueError" and "not a member of process_group" in outside[1], outside


def test_from_env_world_size_not_a_number():
    def fn(rank):
        return Topology.from_env()

    results = run_distributed(_every_rank(fn), 2, local_world_size=2, env={"WORLD_SIZE": "four"}, timeout=60)
    for kind, message, _, _ in results:
        assert kind == "ValueError" and "WORLD_SIZE='four' is not an integer" in message and "export them" in message


# ------------------------------------------------------------------------------------------ a full disk
def _on_small_disk(tmp_path, script: str, size: str = "512k"):
    """Run ``script DISK`` with DISK a tmpfs of ``size`` in a private mount namespace (root, or an unprivileged user
    namespace); skip where neither is allowed."""
    disk = tmp_path / "disk"
    disk.mkdir()
    inner = f'mount -t tmpfs -o size={size} tmpfs "$1" || exit 97; exec "$2" "$3" "$1"'
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for prefix in (["unshare", "--mount", "--propagation", "private"], ["unshare", "--user", "--map-root-user", "-m"]):
        try:
            res = subprocess.run(
                [*prefix, "sh", "-c", inner, "sh", str(disk), sys.executable, script],
                capture_output=True,
                text=True,
                timeout=300,
                env=env,
                cwd=ROOT,
            )
        except FileNotFoundError:
            break
        if res.returncode == 0:
            return [json.loads(line[7:]) for line in res.stdout.splitlines() if line.startswith("RESULT ")]
        if res.returncode != 97 and "unshare" not in res.stderr:
            raise AssertionError(res.stdout[-3000:] + res.stderr[-6000:])
    pytest.skip("making a small tmpfs needs a private mount namespace (root, or unprivileged user namespaces)")


def test_a_full_disk_says_so_and_keeps_the_previous_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    cases = {r["case"]: r for r in _on_small_disk(tmp_path, os.path.join(ROOT, "tests", "_full_disk_script.py"))}
    direct = cases["save_rank_state"]
    assert direct["errno"] == 28 and direct["type"] == "OSError", direct
    assert "is full" in direct["message"] and "bytes free" in direct["message"]
    assert f"The previous {direct['path']} is unchanged" in direct["message"]
    assert direct["unchanged"] and direct["loaded_step"] == 1
    accelerate = cases["accelerate"]  # Birder's state is accelerate's first write: its message surfaces
    assert accelerate["errno"] == 28 and "is full" in accelerate["message"], accelerate
    trainer = cases["trainer"]
    assert trainer["errno"] == 28 and "is full" in trainer["message"], trainer
    assert "The new checkpoint-2 is incomplete (delete it)" in trainer["message"]
    assert "birder" in trainer["first"] and "trainer_state.json" in trainer["first"]  # checkpoint-1 is complete


# ------------------------------------------------------------------------- the agreement check's cost
def _count_checks(rank, world):
    from birder_hf import collectives

    checks = []
    real = collectives._all_gather

    def counting(out, inp, **kwargs):  # the check's all-gather is the only one of int64
        checks.append(inp.dtype == torch.int64)
        return real(out, inp, **kwargs)

    collectives._all_gather = counting
    topo = Topology.flat()
    counts = []
    for numel in (64, 64, 64, 128, 64):
        checks.clear()
        onebit_all_reduce(torch.zeros(numel), topology=topo, method="allgather")
        counts.append(sum(checks))
    # the optimizer-side all-reduce checks before its first step, then never again for the same parameters
    p = torch.nn.Parameter(torch.ones(40))
    opt = Birder([p], lr=0.1, seed=0, topology=topo, method="allgather")
    steps = []
    for _ in range(3):
        checks.clear()
        p.grad = torch.randn(40)
        opt.step()
        steps.append(sum(checks))
    collectives._all_gather = real
    return counts, steps


def test_the_agreement_check_runs_once_per_signature():
    for counts, steps in run_distributed(_count_checks, 2):
        assert counts == [1, 0, 0, 1, 0]
        assert steps == [1, 0, 0]


def test_agreement_benchmark_runs():
    spec = importlib.util.spec_from_file_location("birder_benchmarks_agreement", f"{ROOT}/benchmarks/agreement.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.run(numel=64, calls=3, lookups=100)
    assert result["extra_collectives"] == {"first_call": 1, "later_calls": 0, "later_call_count": 3}
    assert result["cache_lookup_us"] > 0 and result["check_exchange_ms"] > 0


# ------------------------------------------------------------------------------------------ message length
def _fixed_text(node) -> str:
    """The literal text of a message expression; each interpolated value counts as ``{}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join("{}" if isinstance(v, ast.FormattedValue) else _fixed_text(v) for v in node.values)
    if isinstance(node, ast.BinOp):
        return _fixed_text(node.left) + _fixed_text(node.right)
    if isinstance(node, ast.Call):  # explain(what, fix) and the like: the text of every argument
        return "".join(_fixed_text(a) for a in node.args)
    return ""


def test_no_error_message_is_a_paragraph():
    # issue 26 item 6: what is wrong and how to fix it, one clause each (birder_hf.base.explain), not a paragraph;
    # 200 characters of text besides the values it names (26 raises had more, up to 427)
    long = []
    for path in sorted((Path(ROOT) / "src" / "birder_hf").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                text = _fixed_text(node.exc.args[0])
                if len(text) > 200:
                    long.append(f"{path.name}:{node.lineno} ({len(text)} characters): {text[:80]}...")
    assert not long, "\n".join(long)


def test_explain_says_what_then_the_fix():
    from birder_hf.base import explain

    assert explain("lr=nan is not finite", "pass a float >= 0") == "lr=nan is not finite; pass a float >= 0."


def _clipped_direction(rank, world):
    from accelerate import Accelerator

    from birder_hf import attach_ddp_hook
    from birder_hf.integrations.accelerate import register_birder_hook

    out = {}
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
    for name in ("accelerate", "ddp", "ddp-no-op-clip"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = Birder(model.parameters(), lr=0.1, seed=0)
        if name == "accelerate":  # the accelerate idiom, in fp32: no GradScaler involved
            acc = Accelerator(cpu=True)
            model, opt = acc.prepare(model, opt)
            register_birder_hook(acc, model, opt)
            acc.backward(model(x).square().mean())
            before = [p.detach().clone() for p in model.parameters()]
            acc.clip_grad_norm_(model.parameters(), 1.0)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
            attach_ddp_hook(model, opt)
            model(x).square().mean().backward()
            before = [p.detach().clone() for p in model.parameters()]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9 if name == "ddp-no-op-clip" else 1.0)
        try:
            opt.step()
            out[name] = None
        except RuntimeError as exc:
            out[name] = str(exc)
        inner = getattr(opt, "optimizer", opt)
        out[name + "-unchanged"] = all(st["step"] == 0 for st in inner.state.values()) and all(
            torch.equal(a, p) for a, p in zip(before, model.parameters())
        )
    return out


def test_clipping_the_direction_in_grad_is_refused_with_nothing_applied():
    # issue 41: accelerator.clip_grad_norm_ in an fp32 loop clipped the 1-bit direction d (steps shrank to 0.04 lr)
    # without a word; the fp16 refusal (GradScaler.unscale_) did not cover it. A clip that changes nothing passes.
    for out in run_distributed(_clipped_direction, 2, local_world_size=2, timeout=120):
        for name in ("accelerate", "ddp"):
            assert "was changed before step()" in out[name] and "do not clip" in out[name], out[name]
            assert "Nothing was applied" in out[name] and out[name + "-unchanged"]
        assert out["ddp-no-op-clip"] is None and not out["ddp-no-op-clip-unchanged"]


def _with_and_without_zero_grad(rank, world):
    from birder_hf import attach_ddp_hook

    states = {}
    for zero in (True, False):
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 3))
        opt = Birder(model.parameters(), lr=0.1, seed=0)
        attach_ddp_hook(model, opt)
        for step in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
            opt.step()
            if zero:
                opt.zero_grad()
        states[zero] = [(opt.state[p]["exp_avg"].clone(), p.detach().clone()) for p in model.parameters()]
        grads_after_step = [p.grad for p in model.parameters()]
    return states, grads_after_step


def test_a_forgotten_zero_grad_does_not_add_the_direction_into_the_next_gradient():
    # issue 41: .grad kept d after step(); without zero_grad() the next backward accumulated onto it, and the hook
    # encoded g + d (mean |m| 5x too large). step() now hands d over and leaves .grad None, as set_to_none does
    for states, grads_after_step in run_distributed(_with_and_without_zero_grad, 2, timeout=60):
        assert grads_after_step == [None, None]
        for (m, x), (m_forgot, x_forgot) in zip(states[True], states[False]):
            assert torch.equal(m, m_forgot) and torch.equal(x, x_forgot)
