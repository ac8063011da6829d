"""The settings of the 1-bit all-reduce (``method``, ``inter_method``, ``chunk_numel``): names, defaults, the one
check, and what each method sends (:func:`expected_bytes`)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from .wire import fp32_allreduce_bytes

__all__ = [
    "CommSettings",
    "check_settings",
    "expected_bytes",
    "METHODS",
    "INTER_METHODS",
    "DEFAULT_METHOD",
    "DEFAULT_INTER_METHOD",
]

METHODS = ("allgather", "scatter_gather", "hierarchical")
INTER_METHODS = ("allgather", "scatter_gather")
DEFAULT_METHOD = "hierarchical"  # every entry point's default (one node: the exact vote mean)
DEFAULT_INTER_METHOD = "allgather"


def _effective_method(method: str, lws: int, k: int) -> str:
    # One node: hierarchical gives the exact vote mean, as allgather does (bit for bit). Sharing the vote counts
    # costs (L-1)/L·d/8·(1 + bit_length(L)) bytes against allgather's (L-1)·d/8: fewer only from L = 5 ranks on.
    if method == "hierarchical" and k == 1 and 1 + lws.bit_length() >= lws:
        return "allgather"
    return method


def _alignment(method: str, n: int, lws: int, k: int, inter_method: str) -> int:
    # elements per chunk must split into whole bytes for every shard of every stage
    if method == "allgather":
        return 8
    if method == "scatter_gather":
        return 8 * n
    return 8 * lws * (k if inter_method == "scatter_gather" else 1)


def expected_bytes(method: str, numel: int, topology, *, inter_method: str = DEFAULT_INTER_METHOD) -> dict[str, int]:
    """Bytes one rank sends for ``numel`` elements, made exact for padding.

    ``topology`` is a :class:`Topology` or a ``(num_nodes, local_world_size)`` tuple. Returns
    ``intra_node_bytes``, ``inter_node_bytes`` and ``fp32_allreduce_bytes`` (same accounting as
    :class:`CommStats`; independent of ``chunk_numel``). With ``d = numel`` (padded), ``n`` ranks,
    ``k`` nodes of ``L``:

    - allgather: ``(n-1)·d/8`` (intra ``(L-1)·d/8``, inter ``(n-L)·d/8``);
    - scatter_gather: ``2(n-1)/n·d/8`` split the same way;
    - hierarchical: inter ``(k-1)·d/(8L)`` (``inter_method="allgather"``) or ``2(k-1)/k·d/(8L)``
      (``"scatter_gather"``); intra ``(L-1)/L·d/8`` (step 1) plus step 4: ``(L-1)/L·d/8`` for the ±1
      bits (scatter_gather), ``bit_length(k)`` times that for the vote counts (allgather); on one node
      (``k = 1``) the exact mean of the ``L`` votes: as allgather for ``L <= 4``, else step 4 shares their
      counts, ``bit_length(L)`` times ``(L-1)/L·d/8``.
    """
    s = check_settings(method, inter_method)
    method, inter_method = s.method, s.inter_method
    if isinstance(topology, tuple):
        k, lws = topology
        n = k * lws
    else:
        n, lws, k = topology.world_size, topology.local_world_size, topology.num_nodes
    method = _effective_method(method, lws, k)
    align = _alignment(method, n, lws, k, inter_method)
    d = -(-numel // align) * align
    if method in ("allgather", "scatter_gather"):
        per_peer = d // 8 if method == "allgather" else 2 * d // (8 * n)
        intra, inter = (lws - 1) * per_peer, (n - lws) * per_peer
    else:
        shard = d // lws  # elements per node shard
        intra = (lws - 1) * shard // 8  # step 1: all-to-all of the votes
        if k == 1:  # one node: the exact vote counts of L votes, bit_length(L) bits per element
            inter, step4 = 0, lws.bit_length() * shard // 8
        elif inter_method == "allgather":
            inter = (k - 1) * shard // 8
            step4 = k.bit_length() * shard // 8  # the vote counts' binary digits
        else:
            inter = 2 * (k - 1) * (shard // k) // 8
            step4 = shard // 8
        intra += (lws - 1) * step4
    fp32 = fp32_allreduce_bytes(numel, n)
    return {"intra_node_bytes": intra, "inter_node_bytes": inter, "fp32_allreduce_bytes": fp32}


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
            raise ValueError(
                f"Invalid chunk_numel={chunk_numel!r}: chunk_numel must be None (one round) or an int >= 1, the "
                "elements per collective round (e.g. 2**24)."
            )

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