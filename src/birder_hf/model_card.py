"""Model-card text for checkpoints trained with birder-hf (Hub-ready ``README.md`` sections).

Used by the Trainer integration and the recipes; it names the optimizer that was used with the values it
was *configured* with (an LR scheduler leaves ``param_groups[i]["lr"]`` at its last scheduled value; the
configured one is ``initial_lr``), and only that optimizer's settings.
"""

from __future__ import annotations

import os
import re

from .base import OneBitOptimizer, unwrap_optimizer

__all__ = ["optimizer_description", "model_card_section", "fix_trainer_card", "CITATION"]

CITATION = """```bibtex
@inproceedings{birder2023,
    title={Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN Training},
    author={Hanyang Peng, Shuang Qin, Yue Yu, Jin Wang, Hui Wang, Ge Li},
    booktitle={Advances in Neural Information Processing Systems},
    year={2023}
}
```"""


def optimizer_settings(optimizer, communication: dict | None = None) -> dict:
    """The optimizer's configured hyperparameters (first param group) and, for Birder, the communication settings."""
    opt = unwrap_optimizer(optimizer)
    if not isinstance(opt, OneBitOptimizer):
        raise TypeError(f"expected a birder_hf Birder or OneBitAdam optimizer, got {type(opt).__name__}")
    return {**opt.card_settings(), **((communication or {}) if opt.takes_all_reduce_settings else {})}


def optimizer_description(optimizer, communication: dict | None = None) -> str:
    """One line for a model card's ``- optimizer:`` entry."""
    opt = unwrap_optimizer(optimizer)
    values = ", ".join(f"{k}={v}" for k, v in optimizer_settings(opt, communication).items())
    return f"{opt.card_name} with {values}"


def model_card_section(optimizer, communication: dict | None = None) -> str:
    """A model-card section that names the optimizer, its settings and the papers.

    ``communication``: Birder's all-reduce settings (``method``, ``inter_method``, ``chunk_numel``, the node
    layout), listed with the optimizer's.
    """
    opt = unwrap_optimizer(optimizer)
    rows = "\n".join(f"| {k} | {v} |" for k, v in optimizer_settings(opt, communication).items())
    return f"{opt.card_title}\n\n{opt.card_summary}\n\n| setting | value |\n|---|---|\n{rows}\n\n{CITATION}\n"


def _is_hub_id(name: str) -> bool:
    # "bert-base-uncased", "user/model": not a path on this machine
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", name)) and not os.path.exists(name) and not name.startswith(".")


def fix_trainer_card(
    path: str,
    *,
    optimizer_line: str,
    section: str,
    base_model: str = "",
    metrics: dict[str, float] | None = None,
    task: str | list[str] | None = None,
    dataset: str | list[str] | None = None,
) -> None:
    """Correct the ``README.md`` that ``transformers.Trainer.create_model_card`` wrote at ``path``.

    - ``- optimizer:`` names the optimizer used (``optimizer_line``; the Trainer names ``args.optim``), and
      ``section`` (:func:`model_card_section`) is appended;
    - ``base_model`` empty (a randomly initialized model): "trained from scratch" instead of the Trainer's link to an
      empty base model; a local path: "a local checkpoint (name)", no ``huggingface.co/<path>`` link, no
      ``base_model`` metadata (the Hub expects a model id there);
    - ``metrics`` (measured outside the Trainer, which leaves ``model-index`` results empty): the ``model-index``
      results for ``task`` and ``dataset``, and a line of the card.
    """
    from huggingface_hub import EvalResult, ModelCard

    card = ModelCard.load(path)
    lines = card.text.splitlines()
    lines = [optimizer_line if ln.startswith("- optimizer:") else ln for ln in lines]
    if optimizer_line not in lines:
        lines.append(optimizer_line)
    text = "\n".join(lines)
    link = re.compile(r"This model is a fine-tuned version of \[[^\]]*\]\(https://huggingface\.co/[^)]*\) on")
    if not base_model:
        text = link.sub("This model was trained from scratch on", text)
    elif not _is_hub_id(base_model):
        name = os.path.basename(os.path.normpath(base_model))
        text = link.sub(f"This model is a fine-tuned version of a local checkpoint (`{name}`) on", text)
        card.data.base_model = None
    task = task[0] if isinstance(task, (list, tuple)) else task
    dataset = dataset[0] if isinstance(dataset, (list, tuple)) else dataset
    if metrics:
        card.data.model_name = card.data.model_name or os.path.basename(os.path.dirname(os.path.abspath(path)))
        card.data.eval_results = [
            EvalResult(
                task_type=task or "other",
                dataset_type=re.sub(r"[^\w.-]+", "-", dataset or "unknown").strip("-"),
                dataset_name=dataset or "unknown",
                metric_type=name,
                metric_value=round(float(value), 4),
            )
            for name, value in metrics.items()
        ]
        measured = ", ".join(f"{k} {float(v):.2f}" for k, v in metrics.items())
        text = re.sub(r"( dataset\.)\n", rf"\1\nIt achieves on the evaluation set: {measured}.\n", text, count=1)
    card.text = text + "\n\n" + section
    card.save(path)
