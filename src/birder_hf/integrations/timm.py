"""Birder with ``timm``: opt-in registration in timm's optimizer registry.

::

    from birder_hf.integrations.timm import register_with_timm
    register_with_timm()                      # explicit; importing birder_hf never touches timm's registry
    optimizer = timm.optim.create_optimizer_v2(model, "birder", lr=4e-3, weight_decay=0.1, beta=0.95)

timm then builds its usual parameter groups (no weight decay for biases, norm weights, 1-D parameters and
``model.no_weight_decay()``) and hands them to :class:`birder_hf.Birder`. Without the registry:
``Birder(timm.optim.param_groups_weight_decay(model, 0.1), lr=4e-3)``.
"""

from __future__ import annotations

from ..optim import Birder

__all__ = ["register_with_timm", "TIMM_NAME"]

TIMM_NAME = "birder"  # timm splits names on "_", so no underscores


def register_with_timm(name: str = TIMM_NAME) -> None:
    """Register Birder as ``name`` in timm's default optimizer registry (idempotent)."""
    if "_" in name:
        raise ValueError(
            f"timm optimizer names cannot contain '_' (it separates prefixes like lookahead_); got {name!r}"
        )
    try:
        from timm.optim._optim_factory import OptimInfo, default_registry
    except ImportError as exc:
        raise ImportError("register_with_timm needs timm: pip install 'birder-hf[timm]'") from exc
    if name in default_registry._optimizers and default_registry._optimizers[name].opt_class is Birder:
        return
    default_registry.register(
        OptimInfo(
            name=name,
            opt_class=Birder,
            description="Birder: 1-bit adaptive optimizer, Hierarchical-1-bit-All-Reduce (Peng et al., NeurIPS 2023)",
            has_eps=False,
            has_momentum=False,
            has_betas=False,
        )
    )
