"""The Trainer recipes' command line: ``HfArgumentParser`` with the recipe's defaults, shared by ``bert_base.py`` and
``causal_lm.py``.

- ``python recipe.py config.yaml`` (or ``.json``) reads every argument from the file, as the HF examples do;
- otherwise the recipe's defaults apply under the command line, and on a machine without CUDA ``--use_cpu``;
- ``--save_steps N`` without ``--save_strategy`` switches checkpoints on (``"steps"``): the recipes default to
  ``"no"``, and a ``--save_steps`` that wrote nothing left ``--resume_from_checkpoint auto`` (an elastic restart)
  starting from step 0;
- ``--learning_rate``, ``--warmup_steps`` and ``--weight_decay`` must be finite numbers >= 0 (``nan`` reached the
  scheduler and failed there with a traceback);
- ``--output_dir`` and ``--cache_dir`` must be folders this job can write (an unwritable one failed with a traceback
  while the data was prepared, or at the first checkpoint).
"""

from __future__ import annotations

import math
import os

import torch
from transformers import HfArgumentParser


def given_flags(argv: list[str]) -> set[str]:
    """The flags the command line names, without their dashes: ``["--beta=0.8", "--stale", "keep"]`` ->
    ``{"beta", "stale"}``."""
    return {a.split("=", 1)[0][2:] for a in argv if a.startswith("--")}


def is_config_file(argv: list[str]) -> bool:
    """Whether ``argv`` is one YAML or JSON file holding every argument."""
    return len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml"))


def parse_recipe_args(dataclass_types: tuple, argv: list[str], defaults: dict) -> tuple:
    """Parse ``argv`` into ``dataclass_types`` (the last one ``TrainingArguments``) over the recipe's ``defaults``."""
    parser = HfArgumentParser(dataclass_types)
    if is_config_file(argv):
        loader = parser.parse_json_file if argv[0].endswith(".json") else parser.parse_yaml_file
        return tuple(loader(os.path.abspath(argv[0])))
    defaults = dict(defaults, **({} if torch.cuda.is_available() else {"use_cpu": True}))
    given = given_flags(argv)
    if "save_steps" in given and "save_strategy" not in given:
        defaults["save_strategy"] = "steps"  # asking for checkpoints every N steps gets them
    parser.set_defaults(**defaults)
    parsed = tuple(parser.parse_args_into_dataclasses(args=argv))
    training_args = parsed[-1]
    for name in ("learning_rate", "warmup_steps", "weight_decay"):
        value = getattr(training_args, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"--{name} must be a finite number >= 0, got {value!r}.")
    check_writable(training_args.output_dir, "--output_dir")
    for args in parsed:
        if getattr(args, "cache_dir", None):
            check_writable(args.cache_dir, "--cache_dir")
    return parsed


def check_writable(folder: str, flag: str) -> None:
    """Refuse a folder this job could not create or write, by its nearest existing ancestor (nothing is created)."""
    path = os.path.abspath(folder)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise ValueError(f"{flag} {folder}: {path} is a file; choose a folder this job can write.")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {folder}: {path} is not writable; choose a folder this job can write.")


def voters(opt_args) -> int:
    """The workers whose votes Birder averages: every rank under DDP, every node under 1-bit HSDP (the launcher's
    WORLD_SIZE and LOCAL_WORLD_SIZE, or --num_nodes)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if opt_args.sharding != "hsdp":
        return world
    return opt_args.num_nodes or max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def check_local_steps(opt_args) -> None:
    """``--local_steps H`` (``LocalStepsArguments``, mixed into the recipes' optimizer arguments): the inner optimizer
    is an uncompressed one, the model whole on every rank; ``--num_nodes`` also lays out the outer exchange."""
    if not opt_args.local_steps:
        return
    if opt_args.optimizer in ("birder", "onebitadam"):
        raise ValueError(
            f"--local_steps runs an uncompressed inner optimizer alone on each rank, not {opt_args.optimizer} (whose "
            "exchange is every step's); add --optimizer adamw (the outer exchange is 1 bit: --outer_exchange)."
        )
    if opt_args.sharding != "none":
        raise ValueError("--local_steps keeps the whole model on every rank; drop --sharding.")
    if opt_args.outer_num_nodes is None:
        opt_args.outer_num_nodes = opt_args.num_nodes


def local_steps_metrics(trainer) -> dict:
    """The outer exchange's bytes and settings for ``all_results.json`` (nothing without local steps)."""
    local = getattr(trainer, "local_steps", None)
    if local is None:
        return {}
    out = local.stats.as_dict("comm/")
    out["comm/topology"] = repr(local.topology)
    out["comm/method"] = f"local_steps {local.local_steps}, outer exchange {local.exchange}"
    out["outer_steps"] = local.outer_steps
    return out
