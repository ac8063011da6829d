"""The private seams birder-hf uses in other libraries, each checked against the installed version.

Each seam is the only place a framework lets us in (docs/ARCHITECTURE.md, "Seams into other libraries", says why
for each). When a new release moves one, this file fails first and names it, instead of a recipe failing somewhere
in training. Each check asserts the exact shape we rely on (the name, the parameters we pass, the attribute read).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from _dist import run_distributed

# transformers.Trainer's protected methods BirderTrainer / HSDPTrainer override or call, with the parameters we pass
TRAINER_SEAMS = {
    "_save_optimizer_and_scheduler": ["output_dir"],  # every rank's Birder state, inside the checkpoint step
    "_save_checkpoint": ["model", "trial"],  # the completion marker after the Trainer's own files
    "_load_optimizer_and_scheduler": ["checkpoint"],  # each rank loads its own m, b
    "_get_grad_norm": ["model", "grad_norm"],  # no norm of d (it would unscale .grad under fp16)
    "_get_output_dir": ["trial"],  # where resume_from_checkpoint="auto" looks
    "_save": ["output_dir", "state_dict"],  # HSDP: the gathered full state dict, saved by rank 0
    "_load_from_checkpoint": ["resume_from_checkpoint", "model"],  # HSDP: load into the sharded model
    "_defer_fsdp_gradient_reduction": [],  # HSDP: micro-batches before the last keep the unsharded gradient
}


@pytest.mark.parametrize("name, params", sorted(TRAINER_SEAMS.items()))
def test_trainer_protected_methods_we_override_are_there(name, params):
    from transformers import Trainer

    method = getattr(Trainer, name, None)
    assert callable(method), f"transformers.Trainer.{name} is gone: see docs/ARCHITECTURE.md, seams"
    have = list(inspect.signature(method).parameters)[1:]
    assert have[: len(params)] == params, f"Trainer.{name}{inspect.signature(method)}: we pass {params}"


def test_accelerate_reads_a_skipped_step_from_is_overflow():
    # report_skipped_step sets AcceleratedOptimizer._is_overflow: what Accelerator.optimizer_step_was_skipped reads
    from accelerate.optimizer import AcceleratedOptimizer

    opt = AcceleratedOptimizer.__new__(AcceleratedOptimizer)  # no Accelerator needed to read the property
    for skipped in (True, False):
        opt._is_overflow = skipped
        assert opt.step_was_skipped is skipped, "accelerate's step_was_skipped no longer reads _is_overflow"


def test_timm_registry_is_a_dict_of_optim_infos():
    # register_with_timm adds "birder" to timm's default registry (timm has no public way to add one)
    from timm.optim._optim_factory import OptimInfo, default_registry

    assert isinstance(default_registry._optimizers, dict)
    assert all(isinstance(info, OptimInfo) for info in default_registry._optimizers.values())
    assert "adamw" in default_registry._optimizers  # looked up by lower-case name


def _fsdp_param_groups(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fully_shard(model[0], mesh=init_device_mesh("cpu", (world,)))
    groups = list(model[0]._get_fsdp_state()._fsdp_param_groups)
    return len(groups), [tuple(p.sharded_param.shape) for p in groups[0].fsdp_params]


def test_fsdp2_exposes_its_param_groups():
    # fsdp_units reads each FSDP2 module's parameter group: the order its reduce-scatter output holds the parameters
    count, shapes = run_distributed(_fsdp_param_groups, 1)[0]
    assert count == 1 and shapes == [(4, 4), (4,)]
