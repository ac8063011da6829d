"""Trainer, accelerate and timm integrations with real ranks: hook registered, exact resume, errors, cards."""

import os
import socket

import pytest
import torch
from _dist import run_distributed

from birder_hf import Birder, OneBitAdam


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher_env():
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}


class TinyRegressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def forward(self, x, labels=None):
        out = self.body(x)
        loss = None if labels is None else torch.nn.functional.mse_loss(out.squeeze(-1), labels)
        return {"loss": loss, "logits": out}


class Regression(torch.utils.data.Dataset):
    def __init__(self, n=256):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, 8) + 0.05 * torch.randn(n, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def _opt_state(opt):
    state = [opt.state[p] for g in opt.param_groups for p in g["params"]]
    return [{k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()} for st in state]


def _same_state(a, b):
    same = lambda u, v: torch.equal(u, v) if torch.is_tensor(u) else u == v
    return all(set(x) == set(y) and all(same(x[k], y[k]) for k in x) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------- Trainer


def _trainer_run(rank, world, out_dir, resume, max_steps, extra_args=None, birder_args=None):
    from transformers import TrainingArguments

    from birder_hf.integrations.transformers import BirderArguments, BirderTrainer

    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        max_steps=max_steps,
        save_steps=max_steps // 2,
        per_device_train_batch_size=8,
        learning_rate=0.01,
        weight_decay=0.1,
        logging_steps=2,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        **(extra_args or {}),
    )
    trainer = BirderTrainer(
        model=TinyRegressor(),
        args=args,
        train_dataset=Regression(),
        birder_args=BirderArguments(**(birder_args or {"method": "scatter_gather", "beta": 0.9})),
    )
    trainer.train(resume_from_checkpoint=resume)
    ddp_data = trainer.model_wrapped._get_ddp_logging_data() if world > 1 else {}
    opt = trainer.optimizer.optimizer
    return {
        "params": [p.detach().clone() for p in trainer.model.parameters()],
        "state": _opt_state(opt),
        "logs": trainer.state.log_history,
        "comm_hook": ddp_data.get("comm_hook"),
        "max_grad_norm": trainer.args.max_grad_norm,
        "optimizer": type(opt).__name__,
    }


def test_trainer_hook_logs_and_exact_resume(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    extra = {"gradient_accumulation_steps": 2, "bf16": True}  # no_sync micro-batches, bf16 autocast
    straight = run_distributed(
        _trainer_run, 2, a, None, 8, extra, timeout=240, local_world_size=2, env=_launcher_env()
    )
    assert os.path.isfile(os.path.join(a, "checkpoint-4", "birder", "rank_00001-of-00002.pt"))
    resumed = run_distributed(
        _trainer_run,
        2,
        b,
        os.path.join(a, "checkpoint-4"),
        8,
        extra,
        timeout=240,
        local_world_size=2,
        env=_launcher_env(),
    )
    for s, r in zip(straight, resumed):
        assert s["optimizer"] == "Birder" and s["comm_hook"] == "birder_hook"  # the 1-bit hook replaced fp32
        assert s["max_grad_norm"] == 0.0
        assert all(torch.equal(x, y) for x, y in zip(s["params"], r["params"]))
        assert _same_state(s["state"], r["state"])  # every rank's own m and b, bit for bit
    assert all(torch.equal(x, y) for x, y in zip(straight[0]["params"], straight[1]["params"]))
    assert not _same_state(straight[0]["state"], straight[1]["state"])  # m, b are rank-local
    train_logs = [entry for entry in straight[0]["logs"] if "loss" in entry]
    assert train_logs and all(entry["birder/compression_ratio"] > 8 for entry in train_logs)
    assert train_logs[-1]["loss"] < train_logs[0]["loss"]


def test_trainer_with_the_update_rule_options_resumes_exactly(tmp_path):
    # BirderArguments' beta2 / grad_clip / error_feedback reach the optimizer; v and the vote error are saved per rank
    # and resumed bit for bit
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    rule = {"beta": 0.9, "beta2": 0.999, "grad_clip": 0.5, "error_feedback": True}
    kw = dict(timeout=240, local_world_size=2, env=_launcher_env())
    straight = run_distributed(_trainer_run, 2, a, None, 8, None, rule, **kw)
    resumed = run_distributed(_trainer_run, 2, b, os.path.join(a, "checkpoint-4"), 8, None, rule, **kw)
    for s, r in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(s["params"], r["params"]))
        assert _same_state(s["state"], r["state"])
        assert all("exp_avg_sq" in st and "vote_error" in st and "exp_avg_abs" not in st for st in s["state"])
    assert all(torch.equal(x, y) for x, y in zip(straight[0]["params"], straight[1]["params"]))
    train_logs = [entry for entry in straight[0]["logs"] if "loss" in entry]
    assert train_logs[-1]["loss"] < train_logs[0]["loss"]


def test_trainer_onebitadam_hook_logs_and_exact_resume_across_the_switch(tmp_path):
    # 1-bit Adam through the same Trainer seams: checkpoint at step 4 in the warm-up, resume, switch at step 6
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    onebit = {"optimizer": "onebitadam", "freeze_step": 6}
    kw = dict(timeout=240, local_world_size=2)
    straight = run_distributed(_trainer_run, 2, a, None, 10, None, onebit, env=_launcher_env(), **kw)
    resumed = run_distributed(
        _trainer_run, 2, b, os.path.join(a, "checkpoint-5"), 10, None, onebit, env=_launcher_env(), **kw
    )
    for s, r in zip(straight, resumed):
        assert s["optimizer"] == "OneBitAdam" and s["comm_hook"] == "onebit_adam_hook"
        assert all(torch.equal(x, y) for x, y in zip(s["params"], r["params"]))
        assert _same_state(s["state"], r["state"])  # m, v and both error buffers of every rank, bit for bit
        assert all("worker_error" in st for st in s["state"])  # the compressed phase ran
    assert all(torch.equal(x, y) for x, y in zip(straight[0]["params"], straight[1]["params"]))
    last = [entry for entry in straight[0]["logs"] if "loss" in entry][-1]
    assert last["onebit_adam/compressed_steps"] == 4 and last["onebit_adam/compression_ratio"] > 1


def test_trainer_refusals_at_construction(tmp_path):
    from transformers import TrainingArguments

    from birder_hf.integrations.transformers import BirderArguments, BirderTrainer

    def args(**kw):
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)

    BirderTrainer(model=TinyRegressor(), args=args(fp16=True))  # Birder trains with fp16 loss scaling
    with pytest.raises(ValueError, match="1-bit Adam cannot train with fp16.*--bf16"):
        BirderTrainer(model=TinyRegressor(), args=args(fp16=True), birder_args=BirderArguments(optimizer="onebitadam"))
    with pytest.raises(ValueError, match="Trainer's own FSDP.*sharding='hsdp'"):  # refused in one process too
        BirderTrainer(model=TinyRegressor(), args=args(fsdp=True))
    deepspeed = args()  # TrainingArguments(deepspeed=...) imports DeepSpeed, which CI does not install
    deepspeed.deepspeed = "ds_config.json"
    with pytest.raises(ValueError, match="Trainer's own DeepSpeed.*sharding='hsdp'"):
        BirderTrainer(model=TinyRegressor(), args=deepspeed)
    model = TinyRegressor()
    trainer = BirderTrainer(
        model=model,
        args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[]),
        train_dataset=Regression(16),
        optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
    )
    with pytest.raises(TypeError, match=r"Birder \(or OneBitAdam\) optimizer"):
        trainer.train()
    # save_only_model writes no optimizer state: "auto" used to skip every checkpoint as "stopped while writing it"
    only_model = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[], save_only_model=True
    )
    trainer = BirderTrainer(model=TinyRegressor(), args=only_model, train_dataset=Regression(16))
    with pytest.raises(ValueError, match="save_only_model=True.*hold no optimizer state.*save_only_model false"):
        trainer.train(resume_from_checkpoint="auto")
    with pytest.raises(ValueError, match="choose one of birder, onebitadam"):
        BirderArguments(optimizer="adamw")


def test_trainer_resume_without_birder_files_is_an_error(tmp_path):
    from transformers import Trainer, TrainingArguments

    from birder_hf.integrations.transformers import BirderTrainer

    def args(out):
        return TrainingArguments(
            output_dir=out, use_cpu=True, max_steps=2, save_steps=1, report_to=[], disable_tqdm=True
        )

    model = TinyRegressor()
    plain = Trainer(
        model=model,
        args=args(str(tmp_path / "plain")),
        train_dataset=Regression(32),
        optimizer_cls_and_kwargs=(Birder, {"lr": 0.01}),
    )
    plain.train()
    trainer = BirderTrainer(model=TinyRegressor(), args=args(str(tmp_path / "b")), train_dataset=Regression(32))
    with pytest.raises(FileNotFoundError, match="rank-local"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-1"))


def test_model_card_names_birder_and_push_uses_the_hub_api(tmp_path, monkeypatch):
    import transformers.trainer as trainer_mod
    from transformers import TrainingArguments

    from birder_hf.integrations.transformers import BirderArguments, BirderTrainer

    calls = []

    class FakeHub:
        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id))
            return type("RepoUrl", (), {"repo_id": f"user/{repo_id}"})()

        def upload_folder(self, repo_id, folder_path, **kw):
            calls.append(("upload_folder", repo_id, sorted(os.listdir(folder_path))))
            return "https://hub.invalid/commit"

    monkeypatch.setattr(trainer_mod, "hf_api", lambda: FakeHub())
    out = str(tmp_path / "tiny-birder")
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, num_labels=2
    )
    ids = torch.randint(0, 50, (32, 6), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids[i], "labels": int(ids[i, 0] % 2)} for i in range(32)]
    trainer = BirderTrainer(
        model=BertForSequenceClassification(config),
        args=TrainingArguments(output_dir=out, use_cpu=True, max_steps=2, report_to=[], disable_tqdm=True),
        train_dataset=data,
        birder_args=BirderArguments(beta=0.9),
    )
    trainer.train()
    trainer.push_to_hub()
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    assert "- optimizer: Birder" in card and "beta=0.9" in card and "adamw" not in card.lower()
    assert "## Trained with Birder" in card and "birder2023" in card
    assert calls[0] == ("create_repo", "tiny-birder")
    assert calls[1][0] == "upload_folder" and calls[1][1] == "user/tiny-birder" and "README.md" in calls[1][2]


# ---------------------------------------------------------------------------------------------- accelerate


def _accelerate_run(rank, world, ckpt_dir, mode, steps=8, accumulate=2, optimizer="birder"):
    from accelerate import Accelerator

    from birder_hf.integrations.accelerate import register_birder_hook

    acc = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    model = TinyRegressor()
    if optimizer == "birder":
        opt = Birder(model.parameters(), lr=0.01, beta=0.9, weight_decay=0.1, seed=3)
    else:  # the checkpoint (step 4) after the switch: with 4 ranks the warm-up's fp32 sum is only exact up to the
        # bucket layout, which DDP rebuilds after a resume (docs/ONEBIT_ADAM.md); the Trainer test resumes across it
        opt = OneBitAdam(model.parameters(), lr=0.01, weight_decay=0.1, freeze_step=3)
    loader = torch.utils.data.DataLoader(Regression(), batch_size=8, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    state = register_birder_hook(acc, model, opt, **({"method": "hierarchical"} if optimizer == "birder" else {}))
    batches = list(loader)
    start = 0
    if mode == "resume":
        acc.load_state(ckpt_dir)
        start = steps // 2
    for step in range(start, steps):
        for micro in range(accumulate):
            batch = batches[(step * accumulate + micro) % len(batches)]
            with acc.accumulate(model):
                acc.backward(model(**batch)["loss"])
                opt.step()
                opt.zero_grad()
        if mode == "straight" and step + 1 == steps // 2:
            acc.save_state(ckpt_dir)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "state": _opt_state(opt.optimizer),
        "comm_hook": model._get_ddp_logging_data().get("comm_hook"),
        "topology": repr(state.topology),
        "calls": state.stats.calls,
    }


@pytest.mark.parametrize("optimizer, hook", [("birder", "birder_hook"), ("onebitadam", "onebit_adam_hook")])
def test_accelerate_hook_accumulation_and_exact_resume(tmp_path, optimizer, hook):
    ckpt = str(tmp_path / "ckpt")
    kw = dict(optimizer=optimizer)
    straight = run_distributed(
        lambda rank, world: _accelerate_run(rank, world, ckpt, "straight", **kw),
        4,
        timeout=240,
        local_world_size=2,
        env=_launcher_env(),
    )
    assert len(os.listdir(os.path.join(ckpt, "birder"))) == 4
    resumed = run_distributed(
        lambda rank, world: _accelerate_run(rank, world, ckpt, "resume", **kw),
        4,
        timeout=240,
        local_world_size=2,
        env=_launcher_env(),
    )
    for s, r in zip(straight, resumed):
        assert s["comm_hook"] == hook and s["topology"].startswith("Topology(2 nodes x 2")
        assert s["calls"] >= 8  # one synced backward per step (accumulate uses no_sync)
        assert all(torch.equal(x, y) for x, y in zip(s["params"], r["params"]))
        assert _same_state(s["state"], r["state"])


def test_accelerate_refusals():
    def fn(rank, world):
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        from birder_hf.integrations.accelerate import register_birder_hook

        handler = DistributedDataParallelKwargs(comm_hook="fp16")
        acc = Accelerator(cpu=True, kwargs_handlers=[handler])
        model = TinyRegressor()
        model, opt = acc.prepare(model, Birder(model.parameters()))
        errors = []
        try:
            register_birder_hook(acc, model, opt)
        except ValueError as e:
            errors.append(str(e))
        try:
            register_birder_hook(acc, model, torch.optim.SGD(model.parameters(), lr=0.1))
        except TypeError as e:
            errors.append(str(e))
        return errors

    errors = run_distributed(fn, 2, local_world_size=2, env=_launcher_env())[0]
    assert "comm_hook" in errors[0] and "Birder (or OneBitAdam) optimizer" in errors[1]


def test_undistributed_launch_is_refused(monkeypatch):
    from birder_hf.integrations.accelerate import check_really_distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="not really distributed"):
        check_really_distributed(1)
    check_really_distributed(2)


# ---------------------------------------------------------------------------------------------------- timm


def test_timm_factory_drops_the_common_kwargs_birder_does_not_take():
    # timm's convention (and its own suite's test_optim_factory_common_kwargs): create_optimizer_v2 passes eps, betas
    # and momentum to every optimizer that declares them, and drops them for one that does not
    import timm.optim

    from birder_hf.integrations.timm import register_with_timm

    register_with_timm()
    model = torch.nn.Linear(4, 2)
    opt = timm.optim.create_optimizer_v2(model, "birder", lr=1e-3, weight_decay=0.0, momentum=0.9, eps=1e-6,
                                         betas=(0.9, 0.999))  # fmt: skip
    assert isinstance(opt, Birder)
    assert opt.param_groups[0]["beta"] == 0.95 and "betas" not in opt.param_groups[0]
    model(torch.randn(3, 4)).sum().backward()
    opt.step()


def test_timm_registry_builds_birder_with_no_decay_groups():
    import timm
    import timm.optim

    from birder_hf.integrations.timm import register_with_timm

    register_with_timm()
    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    opt = timm.optim.create_optimizer_v2(model, "birder", lr=4e-3, weight_decay=0.1, beta=0.9)
    assert isinstance(opt, Birder)
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    no_decay = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in no_decay) == (p.ndim <= 1), name  # biases and norm weights: no decay
    assert decay and all(g["beta"] == 0.9 for g in opt.param_groups)
    with pytest.raises(ValueError, match="_"):
        register_with_timm("birder_v2")
