"""Ranks that differ take part in the same collectives, or stop together (never a hang until the group's timeout).

- The optimizer-side all-reduce (``Birder(..., process_group=)``): a parameter with a gradient on one rank but not
  another (an unused branch), and a rank with no gradient at all, give exactly the step of a missing gradient taken
  as zero, on every rank.
- Per-rank checkpoints: one rank's missing or corrupt file stops every rank at once with that rank's error, through
  ``read_own_rank_state`` (the load path of accelerate, the Trainer and Lightning) and accelerate's ``load_state``.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed

from birder_hf import Birder
from birder_hf.checkpoint import read_own_rank_state, save_rank_state


class TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x, use_b: bool):
        return self.a(x) + (self.b(x) if use_b else 0)


def _optimizer_side(rank, world, missing: str):
    """Three steps; rank 1's branch ``b`` has no gradient (``missing="branch"``), or rank 1 has none at all
    (``"all"``)."""
    model = TwoBranches()
    opt = Birder(model.parameters(), lr=0.05, weight_decay=0.1, seed=4, process_group=dist.group.WORLD)
    for step in range(3):
        torch.manual_seed(10 * step + rank)
        x = torch.randn(8, 4)
        if rank == 0 or missing == "branch":  # with "all", rank 1 computed nothing
            model(x, use_b=rank == 0).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], [int(opt.state[p]["step"]) for p in model.parameters()]


def _zeros_reference(rank, world, what):
    """The same run with rank 1's missing gradients (branch b, or all) given as explicit zeros."""
    model = TwoBranches()
    opt = Birder(model.parameters(), lr=0.05, weight_decay=0.1, seed=4, process_group=dist.group.WORLD)
    for step in range(3):
        torch.manual_seed(10 * step + rank)
        x = torch.randn(8, 4)
        if rank == 1 and what == "all":
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        else:
            model(x, use_b=rank == 0 or what != "branch").square().mean().backward()
            if rank == 1:
                for p in model.b.parameters():
                    p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], [int(opt.state[p]["step"]) for p in model.parameters()]


@pytest.mark.parametrize("missing", ["branch", "all"])
def test_optimizer_side_missing_gradients_count_as_zero_on_every_rank(missing):
    got = run_distributed(_optimizer_side, 2, missing, timeout=60)
    want = run_distributed(_zeros_reference, 2, missing, timeout=60)
    for (params, steps), (ref_params, ref_steps) in zip(got, want):
        assert steps == ref_steps == [3, 3, 3, 3]  # used on some rank: every rank counts the step
        assert all(torch.equal(p, q) for p, q in zip(params, ref_params))
    assert all(torch.equal(p, q) for p, q in zip(got[0][0], got[1][0]))  # replicas identical


# ------------------------------------------------------------------------------------------- checkpoints
def _trained(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = Birder(model.parameters(), lr=0.1, seed=1)
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()
    return model, opt


def _break(folder, rank, how):
    path = os.path.join(folder, "birder", f"rank_{rank:05d}-of-00002.pt")
    if how == "missing":
        os.remove(path)
    else:
        with open(path, "r+b") as f:
            f.truncate(100)


def _read_everywhere(rank, world, folder, how):
    _, opt = _trained(rank)
    save_rank_state(opt, folder, rank=rank, world_size=world)
    dist.barrier()
    if rank == 0:
        _break(folder, 1, how)
    dist.barrier()
    start = time.monotonic()
    try:
        read_own_rank_state(opt, folder, rank=rank, world_size=world)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


@pytest.mark.parametrize(
    "how, kind, says", [("missing", "FileNotFoundError", "is missing"), ("corrupt", "RuntimeError", "corrupt")]
)
def test_one_ranks_bad_file_stops_every_rank(tmp_path, how, kind, says):
    results = run_distributed(_read_everywhere, 2, str(tmp_path), how, timeout=60)
    for got_kind, message, seconds in results:
        assert got_kind == kind and says in message and "rank_00001" in message, (got_kind, message)
        assert seconds < 10
    assert results[0][1].startswith("rank 1 of 2 could not load its Birder state")
    assert results[0][:2] == results[1][:2]  # the same error on every rank, the rank that failed included


def _raise_together(rank, world, failures, describe):
    from birder_hf.together import raise_together

    how = (lambda r, message: f"rank {r} of {world} lost its file: {message}") if describe else None
    try:
        return "returned", raise_together(failures.get(rank), dist.group.WORLD, payload=10 * rank, describe=how), None
    except Exception as exc:
        return type(exc).__name__, str(exc), type(exc.__cause__).__name__ if exc.__cause__ is not None else None


@pytest.mark.parametrize(
    "failures, describe, want",
    [
        ({}, False, ("returned", [0, 10, 20])),  # nobody failed: every rank's payload, in rank order
        # the lowest failed rank's error on every rank; a type outside SHARED_ERRORS is a RuntimeError naming it
        ({1: KeyError("k"), 2: FileNotFoundError("x")}, False, ("RuntimeError", "rank 1: KeyError: 'k'")),
        ({r: ValueError("same") for r in range(3)}, False, ("ValueError", "same")),  # alike everywhere: no rank named
        ({2: FileNotFoundError("gone")}, True, ("FileNotFoundError", "rank 2 of 3 lost its file: gone")),
    ],
)
def test_raise_together_gives_every_rank_the_same_error(failures, describe, want):
    results = run_distributed(_raise_together, 3, failures, describe, timeout=60)
    for rank, (kind, value, cause) in enumerate(results):
        assert (kind, value) == want, (rank, kind, value)
        # this rank's own failure is the cause of what it raises; a rank that did not fail has none
        assert cause == (type(failures[rank]).__name__ if rank in failures else None), (rank, cause)


def test_raise_together_alone_raises_the_error_itself():
    from birder_hf.together import raise_together

    error = KeyError("k")
    with pytest.raises(KeyError) as info:
        raise_together(error, None)
    assert info.value is error
    assert raise_together(None, None, payload="p") == ["p"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accelerate_load(rank, world, folder):
    from accelerate import Accelerator

    from birder_hf.integrations.accelerate import register_birder_hook

    acc = Accelerator(cpu=True)
    model, opt = _trained()
    model, opt = acc.prepare(model, opt)
    register_birder_hook(acc, model, opt, method="allgather")
    model(torch.randn(4, 4)).square().mean().backward()
    opt.step()
    acc.save_state(folder)
    acc.wait_for_everyone()
    if rank == 0:
        _break(folder, 1, "corrupt")
    acc.wait_for_everyone()
    start = time.monotonic()
    try:
        acc.load_state(folder)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


def test_accelerate_load_state_with_one_corrupt_file_stops_every_rank(tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    results = run_distributed(_accelerate_load, 2, str(tmp_path / "ckpt"), timeout=120, local_world_size=2, env=env)
    for kind, message, seconds in results:
        # the completion marker's record of the file catches it before torch.load would
        assert kind == "RuntimeError" and "rank_00001" in message, (kind, message)
        assert "has 100 bytes, " in message and "when it was marked complete" in message, message
        assert seconds < 10


# ---------------------------------------------------------------- zero_grad(set_to_none=False) under the hook
class ThreeBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x, use_b: bool, use_c: bool):
        return self.a(x) + (self.b(x) if use_b else 0) + (self.c(x) if use_c else 0)


def _hooked(rank, world, set_to_none: bool, bucket_view: bool):
    from birder_hf.hook import attach_ddp_hook

    model = ThreeBranches()
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, find_unused_parameters=True, gradient_as_bucket_view=bucket_view
    )
    opt = Birder(ddp.parameters(), lr=0.1, weight_decay=0.1, seed=0)
    attach_ddp_hook(ddp, opt, method="allgather")
    for step in range(4):
        torch.manual_seed(10 * step + rank)
        opt.zero_grad(set_to_none=set_to_none)
        # b: used by every rank in step 0 only, then by none (its .grad stays a zero tensor with set_to_none=False);
        # c: used by rank 0 only (every rank steps it)
        ddp(torch.randn(8, 4), use_b=step == 0, use_c=rank == 0).square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], [int(opt.state[p]["step"]) for p in model.parameters()]


@pytest.mark.parametrize("bucket_view", [False, True])
def test_zero_grad_without_none_steps_like_set_to_none(bucket_view):
    none = run_distributed(_hooked, 2, True, bucket_view, timeout=60)
    zeros = run_distributed(_hooked, 2, False, bucket_view, timeout=60)
    for (p_none, s_none), (p_zeros, s_zeros) in zip(none, zeros):
        assert s_none == s_zeros == [4, 4, 1, 1, 4, 4]  # a, b (step 0 only), c
        assert all(torch.equal(x, y) for x, y in zip(p_none, p_zeros))
