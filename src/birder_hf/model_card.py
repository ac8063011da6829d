"""Model-card text for checkpoints trained with birder-hf (Hub-ready ``README.md`` sections).

Used by the Trainer integration and the recipes; it names the optimizer that was used with the values it
was *configured* with (an LR scheduler leaves ``param_groups[i]["lr"]`` at its last scheduled value; the
configured one is ``initial_lr``), and only that optimizer's settings.
"""

from __future__ import annotations

import torch

from .base import unwrap_optimizer
from .onebit_adam import OneBitAdam
from .optim import Birder

__all__ = ["optimizer_description", "model_card_section", "CITATION"]

CITATION = """```bibtex
@inproceedings{birder2023,
    title={Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN Training},
    author={Hanyang Peng, Shuang Qin, Yue Yu, Jin Wang, Hui Wang, Ge Li},
    booktitle={Advances in Neural Information Processing Systems},
    year={2023}
}
```"""


def _configured(group: dict, name: str):
    value = group.get("initial_" + name, group[name])
    return float(f"{value.item():.7g}") if isinstance(value, torch.Tensor) else value  # a Tensor lr, as a number


def optimizer_settings(optimizer, communication: dict | None = None) -> dict:
    """The optimizer's configured hyperparameters (first param group) and, for Birder, the communication settings."""
    opt = unwrap_optimizer(optimizer)
    g = opt.param_groups[0]
    if isinstance(opt, OneBitAdam):
        keys = ("lr", "betas", "eps", "weight_decay", "freeze_step", "bias_correction", "scaling")
        return {k: _configured(g, k) if k == "lr" else g[k] for k in keys}
    if isinstance(opt, Birder):
        settings = {k: _configured(g, k) if k == "lr" else g[k] for k in ("lr", "beta", "weight_decay", "amsgrad")}
        settings["seed"] = opt.seed
        return {**settings, **(communication or {})}
    raise TypeError(f"expected a birder_hf Birder or OneBitAdam optimizer, got {type(opt).__name__}")


def optimizer_description(optimizer, communication: dict | None = None) -> str:
    """One line for a model card's ``- optimizer:`` entry."""
    opt = unwrap_optimizer(optimizer)
    values = ", ".join(f"{k}={v}" for k, v in optimizer_settings(opt, communication).items())
    if isinstance(opt, OneBitAdam):
        return f"1-bit Adam (Tang et al. ICML 2021; birder-hf OneBitAdam) with {values}"
    return f"Birder (1-bit adaptive, Peng et al. NeurIPS 2023; birder-hf) with {values}"


def model_card_section(optimizer, communication: dict | None = None) -> str:
    """A model-card section that names the optimizer, its settings and the papers.

    ``communication``: Birder's all-reduce settings (``method``, ``inter_method``, ``chunk_numel``, the node
    layout), listed with the optimizer's.
    """
    opt = unwrap_optimizer(optimizer)
    rows = "\n".join(f"| {k} | {v} |" for k, v in optimizer_settings(opt, communication).items())
    if isinstance(opt, OneBitAdam):
        title = "## Trained with 1-bit Adam (birder-hf)"
        what = (
            "This model was trained with birder-hf's 1-bit Adam (Tang et al., ICML 2021): full-precision Adam for "
            "`freeze_step` steps, then the momentum is exchanged as 1-bit signs with error feedback."
        )
    else:
        title = "## Trained with Birder"
        what = (
            "This model was trained with [birder-hf](https://openreview.net/forum?id=Mlo2kM11ZB): the Birder "
            "optimizer exchanges 1-bit quantized update directions between workers (Hierarchical-1-bit-All-Reduce); "
            "what each method sends per step is in birder-hf's README."
        )
    return f"{title}\n\n{what}\n\n| setting | value |\n|---|---|\n{rows}\n\n{CITATION}\n"
