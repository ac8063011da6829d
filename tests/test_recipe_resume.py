"""Resume through recipes/bert_base.py: 2N steps straight and N + resume + N end with the same bits.

This is what caught the recipe's tokenizer being rebuilt with other ids on resume (now deterministic, and read
from the checkpoint when there is one)."""

import os

import torch
from safetensors.torch import load_file
from test_recipes import BERT_TINY, _torchrun


def test_bert_recipe_resume_is_bitwise_exact(tmp_path):
    a, b = str(tmp_path / "straight"), str(tmp_path / "resumed")
    common = [*BERT_TINY, "--max_steps", "12", "--save_strategy", "steps", "--save_steps", "6"]
    _torchrun(2, "recipes/bert_base.py", *common, "--output_dir", a)
    ckpt = os.path.join(a, "checkpoint-6")
    assert sorted(os.listdir(os.path.join(ckpt, "birder"))) == ["rank_00000-of-00002.pt", "rank_00001-of-00002.pt"]
    _torchrun(2, "recipes/bert_base.py", *common, "--output_dir", b, "--resume_from_checkpoint", ckpt)
    wa, wb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    for rank in range(2):
        name = f"rank_{rank:05d}-of-00002.pt"
        sa = torch.load(os.path.join(a, "checkpoint-12", "birder", name), weights_only=True)["optimizer"]["state"]
        sb = torch.load(os.path.join(b, "checkpoint-12", "birder", name), weights_only=True)["optimizer"]["state"]
        assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
