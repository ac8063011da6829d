"""Per-rank Birder checkpoints: atomic files, exact reload, clear errors, world-size changes."""

import os

import pytest
import torch

from birder_hf import Birder
from birder_hf.checkpoint import load_rank_state, rank_state_path, read_rank_state, save_rank_state


def _trained(seed=0, steps=3, dtype=torch.float32):
    torch.manual_seed(seed)
    p = torch.randn(10, dtype=dtype, requires_grad=True)
    opt = Birder([p], lr=0.1, seed=seed)
    for _ in range(steps):
        p.grad = torch.randn(10, dtype=dtype)
        opt.step()
    return p, opt


def test_round_trip_per_rank(tmp_path):
    for rank in range(2):
        _, opt = _trained(seed=rank)
        save_rank_state(opt, str(tmp_path), rank=rank, world_size=2)
    assert sorted(os.listdir(tmp_path / "birder")) == ["rank_00000-of-00002.pt", "rank_00001-of-00002.pt"]
    for rank in range(2):
        p, ref = _trained(seed=rank)
        _, fresh = _trained(seed=5, steps=1)
        q = fresh.param_groups[0]["params"][0]
        load_rank_state(fresh, str(tmp_path), rank=rank, world_size=2)
        assert fresh.seed == rank
        assert torch.equal(fresh.state[q]["exp_avg"], ref.state[p]["exp_avg"])
        assert torch.equal(fresh.state[q]["exp_avg_abs"], ref.state[p]["exp_avg_abs"])


def test_bf16_params_keep_fp32_state_through_a_reload(tmp_path):
    p, opt = _trained(dtype=torch.bfloat16)
    save_rank_state(opt, str(tmp_path), rank=0, world_size=1)
    q = p.detach().clone().requires_grad_()
    fresh = Birder([q], lr=0.1)
    load_rank_state(fresh, str(tmp_path), rank=0, world_size=1)
    assert fresh.state[q]["exp_avg"].dtype == torch.float32
    assert torch.equal(fresh.state[q]["exp_avg"], opt.state[p]["exp_avg"])


def test_missing_and_corrupt_files_are_clear_errors(tmp_path):
    _, opt = _trained()
    before = {k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items()}
    with pytest.raises(FileNotFoundError, match="rank-local"):
        load_rank_state(opt, str(tmp_path), rank=0, world_size=1)
    save_rank_state(opt, str(tmp_path), rank=0, world_size=2)
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_rank_state(opt, str(tmp_path), rank=1, world_size=2)
    path = rank_state_path(str(tmp_path), 0, 2)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(RuntimeError, match="corrupt"):
        load_rank_state(opt, str(tmp_path), rank=0, world_size=2)
    # nothing was lost: the optimizer's state is untouched by the failed loads
    after = opt.state[opt.param_groups[0]["params"][0]]
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    _, opt = _trained()

    def broken_save(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_rank_state(opt, str(tmp_path), rank=0, world_size=1)
    assert os.listdir(tmp_path / "birder") == []


def test_other_world_size_is_handled_with_a_warning(tmp_path):
    for rank in range(2):
        _, opt = _trained(seed=rank)
        save_rank_state(opt, str(tmp_path), rank=rank, world_size=2)
    with pytest.warns(UserWarning, match="world size 4"):
        state = read_rank_state(str(tmp_path), rank=3, world_size=4)
    assert state["param_groups"][0]["seed"] == 1  # rank 3 takes saved rank 3 mod 2 = 1
    _, opt = _trained()
    save_rank_state(opt, str(tmp_path), rank=0, world_size=3)
    with pytest.raises(RuntimeError, match="several world sizes"):
        read_rank_state(str(tmp_path), rank=0, world_size=2)


def test_files_load_with_weights_only(tmp_path):
    _, opt = _trained()
    path = save_rank_state(opt, str(tmp_path), rank=0, world_size=1)
    payload = torch.load(path, weights_only=True)
    assert payload["rank"] == 0 and "optimizer" in payload


def test_settings_replaced_by_a_loaded_state_are_named(tmp_path):
    # issue 41: beta / stale / amsgrad given anew on resume were overridden by the saved ones without a word (torch's
    # rule, kept); the lr is a scheduler's, and a round trip changes nothing, so neither warns
    import warnings

    p, opt = _trained()
    saved = opt.state_dict()
    resumed = Birder([p], lr=0.5, beta=0.8, stale="keep", seed=opt.seed)
    with pytest.warns(UserWarning, match=r"beta: 0.8 -> 0.95.*stale: 'keep' -> 'fade'.*after loading") as caught:
        resumed.load_state_dict(saved)
    assert "lr" not in str(caught[0].message)
    assert resumed.param_groups[0]["beta"] == 0.95 and resumed.param_groups[0]["stale"] == "fade"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.load_state_dict(resumed.state_dict())
