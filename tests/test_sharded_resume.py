"""A sharded (1-bit HSDP) resume through the Trainer restores every weight (issue 24, item 4).

transformers 5 saves some models under their checkpoints' original key names (a tiny ``ViTForImageClassification``:
16 of its 24 tensors), and the resume used to load them with ``strict=False``: those layers silently stayed freshly
initialised while the optimizer continued from step N. Now every key is restored (renamed as ``from_pretrained``
would), or the resume fails naming the keys, before anything is loaded; only tied weights may be absent.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
from _dist import run_distributed

pytest.importorskip("transformers")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=8,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    return ViTForImageClassification(config)


class Images(torch.utils.data.Dataset):
    def __init__(self, n=128):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 3, 8, 8, generator=g)
        self.y = (self.x.mean(dim=(1, 2, 3)) > 0).long() + (self.x[:, 0].mean(dim=(1, 2)) > 0.1).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def _hsdp_run(rank, world, out_dir, resume):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import TrainingArguments

    from birder_hf.integrations.transformers import BirderArguments, BirderTrainer

    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=8,
        learning_rate=0.01,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = BirderTrainer(
        model=_vit(),
        args=args,
        train_dataset=Images(),
        birder_args=BirderArguments(sharding="hsdp", num_nodes=2, beta=0.9),
    )
    trainer.train(resume_from_checkpoint=resume)
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in full.items()}


def test_a_sharded_resume_of_a_model_saved_under_other_keys_restores_every_weight(tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    straight = run_distributed(_hsdp_run, 4, a, None, timeout=400, local_world_size=2, env=env)
    from safetensors.torch import load_file

    saved = load_file(os.path.join(a, "checkpoint-2", "model.safetensors"))
    assert set(saved) - set(straight[0])  # the checkpoint holds keys under other names than the model's
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    resumed = run_distributed(
        _hsdp_run, 4, b, os.path.join(a, "checkpoint-2"), timeout=400, local_world_size=2, env=env
    )
    for s, r in zip(straight, resumed):  # before: 16 of 24 tensors resumed from their initial values
        assert s.keys() == r.keys()
        differ = [k for k in s if not torch.equal(s[k], r[k])]
        assert not differ, differ


def test_weights_that_do_not_cover_the_model_are_refused_naming_the_keys(tmp_path):
    from safetensors.torch import load_file

    from birder_hf.integrations.hsdp_trainer import _model_keys

    model = _vit()
    model.save_pretrained(str(tmp_path))
    saved = load_file(os.path.join(tmp_path, "model.safetensors"))
    state = _model_keys(model, dict(saved), str(tmp_path))
    assert state.keys() == model.state_dict().keys()  # renamed back: every key of the model
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    gone = "vit.encoder.layer.1.attention.attention.value.weight"
    assert gone in saved
    with pytest.raises(ValueError, match=r"1 of its \d+ keys are not there: \['vit\.layers\.1\.attention\.v_proj"):
        _model_keys(model, {k: v for k, v in saved.items() if k != gone}, str(tmp_path))
    with pytest.raises(ValueError, match=r"saved keys are not the model's: \['extra.weight'\].*Nothing was loaded"):
        _model_keys(model, {**saved, "extra.weight": torch.zeros(1)}, str(tmp_path))


def test_a_tied_weight_may_be_absent():
    from birder_hf.integrations.hsdp_trainer import _model_keys

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 4)
            self.head = torch.nn.Linear(4, 5, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    state = _model_keys(model, {"embed.weight": torch.zeros(5, 4)}, "ckpt")
    assert list(state) == ["embed.weight"]
    with pytest.raises(ValueError, match=r"keys are not there: \['embed.weight', 'head.weight'\]"):
        _model_keys(model, {}, "ckpt")
