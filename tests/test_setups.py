"""Set-ups users bring, on real ranks: torch.compile-d models (accelerate and the Trainer) and new models per trial
(``model_init``, ``Trainer.hyperparameter_search``). ``docs/SETUPS.md`` lists every supported set-up and its test.
"""

import os
from types import SimpleNamespace

import pytest
import torch
from _dist import run_distributed
from test_integrations import Regression, TinyRegressor, _launcher_env

from birder_hf import Birder
from birder_hf.base import unwrap_optimizer

# inductor, what accelerate's dynamo_backend="inductor" and TrainingArguments(torch_compile=True) use by default
BACKEND = "inductor"


def _is_direction(grads, world):
    # after the hook .grad holds d: the mean of the ranks' +-1 votes (allgather on one node), a multiple of 1/world
    return all(bool((g.abs() <= 1).all() and torch.equal((g * world).round(), g * world)) for g in grads)


# ---------------------------------------------------------------------------------------------- torch.compile
def _accelerate_compiled(rank, world, steps=3):
    from accelerate import Accelerator

    from birder_hf.integrations.accelerate import register_birder_hook

    acc = Accelerator(cpu=True, dynamo_backend=BACKEND)
    model = TinyRegressor()
    opt = Birder(model.parameters(), lr=0.01, seed=3)
    model, opt = acc.prepare(model, opt)
    compiled = type(model).__name__
    state = register_birder_hook(acc, model, opt)
    directions = []
    for t in range(steps):
        g = torch.Generator().manual_seed(10 * rank + t)
        x = torch.randn(8, 8, generator=g)
        acc.backward(model(x, labels=x.sum(1))["loss"])
        directions.append(_is_direction([p.grad for p in model.parameters()], world))
        opt.step()
        opt.zero_grad()
    return {
        "compiled": compiled,
        "directions": directions,
        "calls": state.stats.calls,
        "bytes": state.stats.total_bytes,
        "steps": state.steps_communicated,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def test_compiled_model_through_accelerate_trains_with_the_hook():
    res = run_distributed(_accelerate_compiled, 2, timeout=600, local_world_size=2, env=_launcher_env())
    for r in res:
        assert r["compiled"] == "OptimizedModule"  # accelerate returned the compiled wrapper around DDP
        assert all(r["directions"]) and r["steps"] == 3 and r["calls"] >= 3 and r["bytes"] > 0
    assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"]))


def _trainer_compiled(rank, world, out_dir):
    from transformers import TrainerCallback, TrainingArguments

    from birder_hf.integrations.transformers import BirderTrainer

    class Record(TrainerCallback):
        def __init__(self):
            self.directions = []

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.directions.append(_is_direction([p.grad for p in model.parameters()], world))

    record = Record()
    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        max_steps=3,
        per_device_train_batch_size=8,
        learning_rate=0.01,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        torch_compile=True,
        torch_compile_backend=BACKEND,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
    )
    trainer = BirderTrainer(model=TinyRegressor(), args=args, train_dataset=Regression(64), callbacks=[record])
    trainer.train()
    state = trainer.birder_hook_state
    return {
        "compiled": type(trainer.model_wrapped).__name__,
        "directions": record.directions,
        "steps": state.steps_communicated,
        "bytes": state.stats.total_bytes,
        "params": [p.detach().clone() for p in trainer.model.parameters()],
    }


def test_compiled_model_through_the_trainer_trains_with_the_hook(tmp_path):
    res = run_distributed(_trainer_compiled, 2, str(tmp_path), timeout=600, local_world_size=2, env=_launcher_env())
    for r in res:
        assert r["compiled"] == "OptimizedModule"
        assert r["directions"] == [True] * 3 and r["steps"] == 3 and r["bytes"] > 0
    assert all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"]))


# -------------------------------------------------------------------------------- model_init, hyperparameter search
def _args(out_dir, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        per_device_train_batch_size=8,
        learning_rate=0.01,
        logging_steps=2,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        **kw,
    )


def _model_init_trials(rank, world, out_dir):
    from transformers.trainer_utils import HPSearchBackend

    from birder_hf.integrations.transformers import BirderTrainer

    trainer = BirderTrainer(model_init=TinyRegressor, args=_args(out_dir), train_dataset=Regression(64))
    trials = []
    for _ in range(2):  # what every trial of a hyperparameter search does: a new model, DDP module and Birder
        trainer.train()
        state = trainer.birder_hook_state
        trials.append(
            {
                "state": state,
                "current": state.optimizer is unwrap_optimizer(trainer.optimizer),
                "comm_hook": trainer.model_wrapped._get_ddp_logging_data().get("comm_hook"),
                "steps": state.steps_communicated,
                "ratio_logged": [e["birder/compression_ratio"] > 8 for e in trainer.state.log_history if "loss" in e],
            }
        )
    first, second = trials
    # A search's trial saves into run-<trial>/checkpoint-N (optuna is not installed in CI: this is the Trainer's own
    # checkpoint routine, called as a trial calls it; test_hyperparameter_search_with_optuna runs a real search)
    trainer.hp_search_backend = HPSearchBackend.OPTUNA
    trainer._save_checkpoint(trainer.model_wrapped, SimpleNamespace(number=7))
    return {
        "new_state": second["state"] is not first["state"],
        "first_released": first["state"].topology.closed,
        "current": [t["current"] for t in trials],
        "comm_hook": [t["comm_hook"] for t in trials],
        "steps": [t["steps"] for t in trials],
        "ratio_logged": [all(t["ratio_logged"]) for t in trials],
    }


def test_model_init_trials_each_get_the_hook_and_their_own_checkpoint_folder(tmp_path):
    out = str(tmp_path)
    res = run_distributed(_model_init_trials, 2, out, timeout=300, local_world_size=2, env=_launcher_env())
    for r in res:
        assert r["new_state"] and r["first_released"] and r["current"] == [True, True]
        assert r["comm_hook"] == ["birder_hook", "birder_hook"]  # not fp32 DDP averaging in the second trial
        assert r["steps"] == [4, 4] and r["ratio_logged"] == [True, True]  # fresh statistics per trial
    for rank in range(2):
        assert os.path.isfile(os.path.join(out, "run-7", "checkpoint-4", "birder", f"rank_0000{rank}-of-00002.pt"))


def _optuna_search(rank, world, out_dir):
    from transformers import TrainerCallback

    from birder_hf.integrations.transformers import BirderTrainer

    trainer = BirderTrainer(
        model_init=TinyRegressor, args=_args(out_dir), train_dataset=Regression(64), eval_dataset=Regression(16)
    )
    seen = []

    class Record(TrainerCallback):  # the hook and the optimizer of every trial
        def on_train_end(self, args, state, control, **kwargs):
            s = trainer.birder_hook_state
            seen.append((s.optimizer is unwrap_optimizer(trainer.optimizer), s.steps_communicated))

    trainer.add_callback(Record())
    trainer.hyperparameter_search(
        direction="minimize",
        backend="optuna",
        n_trials=2,
        hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-3, 1e-2, log=True)},
    )
    return seen


def test_hyperparameter_search_with_optuna(tmp_path):
    pytest.importorskip("optuna", reason="optuna is not installed (CI runs the model_init test above instead)")
    out = str(tmp_path)
    res = run_distributed(_optuna_search, 2, out, timeout=600, local_world_size=2, env=_launcher_env())
    assert all(seen == [(True, 4), (True, 4)] for seen in res)
    for trial in range(2):
        for rank in range(2):
            assert os.path.isfile(
                os.path.join(out, f"run-{trial}", "checkpoint-4", "birder", f"rank_0000{rank}-of-00002.pt")
            )
