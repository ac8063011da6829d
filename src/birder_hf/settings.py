"""The settings of the 1-bit all-reduce (``method``, ``inter_method``, ``chunk_numel``): names, defaults and the one
check (:class:`CommSettings`)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

__all__ = [
    "CommSettings",
    "check_settings",
    "METHODS",
    "INTER_METHODS",
    "DEFAULT_METHOD",
    "DEFAULT_INTER_METHOD",
]

METHODS = ("allgather", "scatter_gather", "hierarchical")
INTER_METHODS = ("allgather", "scatter_gather")
DEFAULT_METHOD = "hierarchical"  # every entry point's default (one node: the exact vote mean)
DEFAULT_INTER_METHOD = "allgather"


@dataclass(frozen=True)
class CommSettings:
    """The 1-bit all-reduce's settings, checked once, here, when the object is built; every layer below the entry
    point that builds it (hook states, ``StepAllReduce``, :func:`onebit_all_reduce`, the agreement) takes it whole.

    Args:
        method (`str`, *optional*, defaults to `"hierarchical"`): ``"allgather"``, ``"scatter_gather"`` or
            ``"hierarchical"``.
        inter_method (`str`, *optional*, defaults to `"allgather"`): hierarchical's inter-node exchange.
        chunk_numel (`int`, *optional*): elements per collective round (``None``: one round).
    """

    method: str = DEFAULT_METHOD
    inter_method: str = DEFAULT_INTER_METHOD
    chunk_numel: int | None = None

    def __post_init__(self):
        method, inter_method, chunk_numel = self.method, self.inter_method, self.chunk_numel
        if not isinstance(method, str) or method not in METHODS:
            raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")
        if not isinstance(inter_method, str) or inter_method not in INTER_METHODS:
            raise ValueError(f"unknown inter_method {inter_method!r}; valid: {', '.join(INTER_METHODS)}")
        if chunk_numel is not None and not (
            isinstance(chunk_numel, numbers.Integral) and not isinstance(chunk_numel, bool) and chunk_numel >= 1
        ):
            fix = "pass None (one round) or an int >= 1, the elements per collective round (e.g. 2**24)"
            raise ValueError(f"Invalid chunk_numel={chunk_numel!r}; {fix}.")

    def as_dict(self) -> dict:
        return {"method": self.method, "inter_method": self.inter_method, "chunk_numel": self.chunk_numel}


def check_settings(
    method: str | CommSettings = DEFAULT_METHOD,
    inter_method: str = DEFAULT_INTER_METHOD,
    chunk_numel: int | None = None,
) -> CommSettings:
    """The :class:`CommSettings` of ``method``, ``inter_method`` and ``chunk_numel``; ``ValueError`` if one is invalid.

    ``method`` may be a :class:`CommSettings` already (checked when it was built): it is returned as it is, and
    ``inter_method`` and ``chunk_numel`` must then be left unset.
    """
    if not isinstance(method, CommSettings):
        return CommSettings(method, inter_method, chunk_numel)
    if inter_method != DEFAULT_INTER_METHOD or chunk_numel is not None:
        raise TypeError("pass inter_method and chunk_numel inside the CommSettings, not beside it")
    return method
