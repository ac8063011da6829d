"""n Birder workers in one process (issue 25, item 3): quality per step at the paper's worker counts (32-64) without
32-64 processes.

The testbed has 4 workers, the noisiest case for a vote mean (Var(d) shrinks as 1/n). This simulates ``k`` nodes x
``L`` ranks of the default method (``hierarchical``, ``inter_method="allgather"``) with the library's own code for
every number that reaches the parameters:

- **encode**: one :class:`birder_hf.Birder` per worker (its own m and b), ``Birder.encode`` on the worker's gradient;
- **vote**: ``BitKeys.quantize_pack`` with each worker's antithetic role (``quantize.antithetic``), the same keys the
  DDP hook uses (``Birder.bit_keys``);
- **node re-quantization and mean**: ``BitKeys.requantize_pack`` with the node's antithetic role, then the vote counts
  (``collectives._count_planes``) and ``quantize.digits_mean_``, as ``collectives._Hierarchical.finish`` does;
- **apply**: ``birder_apply``.

What is this module's own is only the routing (which rank's bytes meet which), the part a real run does with
all-to-all and all-gather; ``tests/test_simulate_workers.py`` checks that 2 x 2 simulated workers give the parameters
of a real 4-rank DDP run with the hook, bit for bit. The bits do not depend on how the buffer is cut into buckets or
chunks (``tests/test_collectives.py::test_independent_of_segment_layout_and_chunking``), so one flat buffer of all
parameters stands for DDP's buckets.
"""

from __future__ import annotations

import torch

from birder_hf import Birder
from birder_hf.collectives import _count_planes
from birder_hf.optim import birder_apply
from birder_hf.quantize import STAGE_NODE, STAGE_WORKER, BitKeys, antithetic, digits_mean_

__all__ = ["hierarchical_mean", "SimulatedWorkers"]


def hierarchical_mean(us: list[torch.Tensor], keys: BitKeys, nodes: int, local: int) -> torch.Tensor:
    """``d`` of ``onebit_all_reduce(u_r, method="hierarchical", inter_method="allgather")`` over ``nodes`` x ``local``
    ranks (rank ``g * local + j`` is local rank ``j`` of node ``g``), from every rank's flat ``u`` in one process."""
    if nodes < 2:
        raise ValueError("simulate at least 2 nodes (one node is allgather's exact mean of the votes)")
    n, numel = nodes * local, us[0].numel()
    if len(us) != n:
        raise ValueError(f"{len(us)} workers' u for {nodes} x {local} ranks")
    align = 8 * local
    padded = -(-numel // align) * align
    shard = padded // local
    packed = []
    for r, u in enumerate(us):  # each worker's own vote, as one of an antithetic pair of ranks
        who, reflect = antithetic(r)
        bits = keys.quantize_pack(u.reshape(-1), 0, STAGE_WORKER, who, reflect=reflect)
        packed.append(torch.cat([bits, bits.new_zeros(padded // 8 - bits.numel())]))  # padding votes -1
    out = torch.empty(numel, dtype=us[0].dtype, device=us[0].device)
    for j in range(local):  # local rank j of every node owns shard j
        lo8, hi8 = j * shard // 8, (j + 1) * shard // 8
        node_bits = []
        for g in range(nodes):
            rows = torch.stack([packed[g * local + i][lo8:hi8] for i in range(local)])  # the intra-node all-to-all
            if local == 1:
                node_bits.append(rows[0])
            else:
                who, reflect = antithetic(g)
                node_bits.append(keys.requantize_pack(rows, j * shard, STAGE_NODE, who, reflect=reflect))
        planes = _count_planes(torch.stack(node_bits))  # the inter-node all-gather, as vote counts
        lo = min(j * shard, numel)
        digits_mean_(out[lo : min(lo + shard, numel)], planes, nodes)
    return out


class SimulatedWorkers:
    """``nodes`` x ``local`` Birder workers sharing one set of parameters, each with its own m and b.

    ``step(grads)`` takes each worker's gradients (a list per worker, in ``params`` order), encodes them, runs the
    simulated 1-bit all-reduce and applies ``d``. ``optimizers[0]``'s learning rate is the one applied (give a
    scheduler that one).
    """

    def __init__(self, params, nodes: int, local: int, **birder_kwargs):
        self.params = list(params)
        self.nodes, self.local = nodes, local
        self.optimizers = [Birder(self.params, **birder_kwargs) for _ in range(nodes * local)]

    @torch.no_grad()
    def step(self, grads: list[list[torch.Tensor]]) -> torch.Tensor:
        lead = self.optimizers[0]
        us = []
        for opt, gs in zip(self.optimizers, grads, strict=True):
            (group,) = opt.param_groups
            us.append(torch.cat([u.reshape(-1) for u in opt.encode(group, self.params, gs)]))
        self.last_us = us  # every worker's flat u of this step (benchmarks/vote_strength.py reads it)
        steps = [int(lead.state[p]["step"]) for p in self.params]
        d = hierarchical_mean(us, lead.bit_keys(self.params, steps), self.nodes, self.local)
        (group,) = lead.param_groups
        ds = list(d.split([p.numel() for p in self.params]))
        birder_apply(self.params, [x.view_as(p) for x, p in zip(ds, self.params)], lr=group["lr"],
                     weight_decay=group["weight_decay"])  # fmt: skip
        return d
