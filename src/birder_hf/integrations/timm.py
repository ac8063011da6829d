"""Birder with ``timm``: opt-in registration in timm's optimizer registry.

::

    from birder_hf.integrations.timm import register_with_timm
    register_with_timm()                      # explicit; importing birder_hf never touches timm's registry
    optimizer = timm.optim.create_optimizer_v2(model, "birder", lr=4e-3, weight_decay=0.1, beta=0.95)

timm then builds its usual parameter groups (no weight decay for biases, norm weights, 1-D parameters and
``model.no_weight_decay()``) and hands them to :class:`birder_hf.Birder`. As for timm's SGD, the factory drops the
common ``eps=`` and ``betas=`` (``train.py``'s ``--opt-eps``, ``--opt-betas``): they do not reach Birder, whose one EMA
factor is ``beta=`` (``--opt-kwargs beta=0.95``). Without the registry:
``Birder(timm.optim.param_groups_weight_decay(model, 0.1), lr=4e-3)``.
"""

from __future__ import annotations

from ..base import explain
from ..optim import Birder

__all__ = ["register_with_timm", "TIMM_NAME"]

TIMM_NAME = "birder"  # timm splits names on "_", so no underscores


def register_with_timm(name: str = TIMM_NAME) -> None:
    """Register Birder as ``name`` in timm's default optimizer registry (idempotent).

    Refuses a name timm already uses for another optimizer (``"adamw"``: registering would replace timm's own for the
    whole process), an empty one, and one with ``_`` (timm splits names on it).
    """
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"Invalid name={name!r}: a timm optimizer name is a non-empty string, e.g. 'birder'.")
    if "_" in name:
        raise ValueError(
            f"timm optimizer names cannot contain '_' (it separates prefixes like lookahead_); got {name!r}"
        )
    try:
        from timm.optim._optim_factory import OptimInfo, default_registry
    except ImportError as exc:
        raise ImportError("register_with_timm needs timm: pip install 'birder-hf[timm]'") from exc
    existing = default_registry._optimizers.get(name.lower())  # timm looks names up in lower case
    if existing is not None:
        if existing.opt_class is Birder:
            return
        owner = getattr(existing.opt_class, "__name__", existing.opt_class)
        what = f"timm already has an optimizer named {name.lower()!r} ({owner}); Birder would replace timm's own"
        raise ValueError(explain(what, f"Pick a free name, e.g. register_with_timm('{TIMM_NAME}')"))
    default_registry.register(
        OptimInfo(
            name=name,
            opt_class=Birder,
            description="Birder: 1-bit adaptive optimizer, Hierarchical-1-bit-All-Reduce (Peng et al., NeurIPS 2023)",
            # timm's convention: the factory drops the common eps= and betas= (train.py's --opt-eps, --opt-betas) for
            # an optimizer that declares neither, as for SGD; Birder has one beta (pass beta=), and no eps
            has_eps=False,
            has_momentum=False,
            has_betas=False,
        )
    )
