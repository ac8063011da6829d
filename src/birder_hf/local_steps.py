"""Local steps with a 1-bit outer exchange: DiLoCo's outer loop over Birder's Hierarchical-1-bit-All-Reduce.

DiLoCo (Douillard et al. 2023, https://arxiv.org/abs/2311.08105): each rank runs ``H`` steps of its own inner
optimizer (AdamW) on its own data, with nothing crossing the wire; then the ranks average the pseudo-gradient
``Δ = θ_outer - θ_local`` and take one outer Nesterov step, from which every rank continues. Birder (Peng et al.,
NeurIPS 2023) supplies the exchange: the hierarchical 1-bit all-reduce (:func:`birder_hf.onebit_all_reduce`). The
combination, and the encoding below, are ours (no paper describes them):

.. math::
    e_r = Δ_r + ε_r, \\qquad s_b = \\frac{1}{n} \\sum_r \\mathrm{mean}_{i \\in b} |e_{r,i}|, \\qquad
    d = \\mathrm{OneBitAllReduce}(\\mathrm{sign}(e_r)), \\qquad g_i = s_{b(i)} d_i, \\qquad
    ε_{r,i} \\leftarrow e_{r,i} - s_{b(i)} \\mathrm{sign}(e_{r,i})

    m \\leftarrow μ m + g, \\qquad θ_{outer} \\leftarrow θ_{outer} - η (g + μ m), \\qquad θ_r \\leftarrow θ_{outer}

- ``exchange="onebit"`` (default, ``encoding="sign"``): each rank sends the sign of its error-fed pseudo-gradient
  (error feedback, Karimireddy et al. 2019, as in 1-bit Adam's compressor) with one scale per block ``b`` of
  ``scale_block`` elements inside each tensor (``None``: per tensor), ``s_b``: the ranks' mean of ``mean|e|``,
  all-gathered as fp32 numbers and summed in rank order, so identical on every rank (32 bits per block per rank);
  ``E[d]`` is the ranks' mean sign, exact inside a node, 1 bit across nodes. A rank's ``ε`` is what it has not sent
  yet (``tests/test_local_steps.py``: without it, a +1 and a -1 vote cancel whatever their sizes);
- ``encoding="stochastic"``: Birder's own binary randomization of ``u = e / s_max`` (``s_max``: the largest
  ``|e|`` of the block on any rank), ``g = s_max d``, an unbiased estimate of the mean pseudo-gradient, without
  error feedback (with it, it diverged: its errors, fed back, raise the next round's scale);
- ``exchange="fp32"``: DiLoCo as published: an fp32 all-reduce of ``Δ`` (the baseline).

Every rank ends an outer step with the same ``θ_outer`` bit for bit: ``d`` and ``s`` are identical on every rank,
and so is every float operation after them. Floating-point buffers (BatchNorm's running statistics) are averaged at
each outer step (all-gathered, summed in rank order). Under DDP, :class:`LocalSteps` registers a hook that returns
each bucket as it is (no gradient all-reduce) and turns DDP's per-forward buffer broadcast off: between outer steps
nothing crosses the wire.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import INTEGER, NON_NEGATIVE, choice, explain, is_integer, is_real_number, rule, unwrap_optimizer
from .collectives import CommStats, Wire, fp32_allreduce_bytes, onebit_all_reduce, own_votes
from .quantize import BitKeys
from .settings import DEFAULT_INTER_METHOD, DEFAULT_METHOD, check_settings
from .topology import Topology

__all__ = ["LocalSteps", "EXCHANGES", "ENCODINGS"]

EXCHANGES = ("onebit", "fp32")
ENCODINGS = ("sign", "stochastic")
_SETTINGS = ("local_steps", "exchange", "encoding", "scale_block")  # a state resumes with the same ones
_TENSORS = ("outer", "momentum", "error", "params", "buffers")


def _local_only(state, bucket):
    """DDP communication hook that exchanges nothing: each rank keeps its own gradient (DiLoCo's inner steps)."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


# every argument's rule, as the optimizers' settings tables (birder_hf.base)
RULES = {
    "local_steps": rule(lambda v: is_integer(v) and v >= 1, "an int >= 1 (inner steps per outer step)"),
    "outer_lr": NON_NEGATIVE,
    "outer_momentum": rule(lambda v: is_real_number(v) and 0 <= v < 1, "a finite float in [0, 1)"),
    "exchange": choice(EXCHANGES),
    "encoding": choice(ENCODINGS),
    "scale_block": rule(lambda v: v is None or (is_integer(v) and v >= 1), "an int >= 1, or None (one per tensor)"),
    "seed": INTEGER,
}


class LocalSteps:
    """Run ``local_steps`` inner optimizer steps per rank, then one outer step on the exchanged pseudo-gradient.

    Call :meth:`step` after every ``optimizer.step()`` (also after a step a ``GradScaler`` skipped: every rank must
    count alike); every ``local_steps``-th call exchanges. :meth:`finish` (or leaving a ``with`` block) exchanges a
    partial round, so that every rank ends with the same weights.

    Args:
        model (`torch.nn.Module`): the model, DDP-wrapped or not (DDP: its gradient all-reduce is switched off).
        optimizer: the inner optimizer (any ``torch.optim.Optimizer``, e.g. AdamW, or a framework's wrapper of one);
            its state is per rank and is saved and restored with this object's (:meth:`state_dict`).
        local_steps (`int`): ``H``, inner steps per outer step (>= 1).
        outer_lr (`float`, defaults to 0.7) and outer_momentum (`float`, defaults to 0.5): the outer Nesterov
            step's ``η`` and ``μ``. With DiLoCo's ``μ = 0.9`` (for ``H`` in the hundreds) the BERT recipe at ``H = 10``
            ended at a median F1 of 25.1 over seeds 0-2, with ``(0.7, 0.5)`` at 55.9, the 1-bit exchange's best there
            at ``H = 10`` and ``50`` (``docs/BENCHMARKS.md``, "Local steps").
        exchange (`str`, defaults to ``"onebit"``): ``"onebit"`` | ``"fp32"``.
        encoding (`str`, defaults to ``"sign"``): ``"onebit"`` only: ``"sign"`` | ``"stochastic"`` (above).
        scale_block (`int`, *optional*): ``"onebit"`` only: elements per scale inside a tensor (``None``: one
            scale per tensor).
        topology (`Topology`, *optional*): where the ranks are (default ``Topology.from_env()``, collective).
        method, inter_method: the 1-bit all-reduce's (:func:`birder_hf.onebit_all_reduce`).
        seed (`int`): the 1-bit exchange's random bits (counter-based: seed, outer step, element).

    ``stats`` (:class:`birder_hf.CommStats`) counts every byte this rank sends, the scales and buffers included;
    ``stats.fp32_allreduce_bytes`` is what DDP would have sent for the same inner steps.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer,
        *,
        local_steps: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.5,
        exchange: str = "onebit",
        encoding: str = "sign",
        scale_block: int | None = None,
        topology: Topology | None = None,
        method: str = DEFAULT_METHOD,
        inter_method: str = DEFAULT_INTER_METHOD,
        seed: int = 0,
    ):
        given = dict(local_steps=local_steps, outer_lr=outer_lr, outer_momentum=outer_momentum, exchange=exchange)
        given.update(encoding=encoding, scale_block=scale_block, seed=seed)
        for name, value in given.items():
            problem = RULES[name].problem(value)
            if problem is not None:
                raise ValueError(f"Invalid {name}={value!r}: {problem.format(name=name)}.")
        self.comm_settings = check_settings(method, inter_method)
        self.local_steps, self.exchange, self.encoding, self.seed = int(local_steps), exchange, encoding, int(seed)
        self.outer_lr, self.outer_momentum, self.scale_block = float(outer_lr), float(outer_momentum), scale_block
        self.error_feedback = exchange == "onebit" and encoding == "sign"
        self.inner_optimizer = unwrap_optimizer(optimizer)
        ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
        module = getattr(model, "module", model) if ddp is not None else model
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("LocalSteps: the model has no parameter that requires a gradient.")
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.topology = (topology or Topology.from_env()) if on else None
        self.stats = CommStats()
        self.inner_steps = self.outer_steps = 0
        if ddp is not None:
            ddp.register_comm_hook(None, _local_only)
            ddp.broadcast_buffers = False  # DDP would broadcast rank 0's buffers before every forward
        elif self.topology is not None:  # every rank starts from rank 0's weights (DDP does this when it wraps)
            group = self.topology.world_group
            first = dist.get_global_rank(group, 0)  # the group's rank 0 (a group of ranks 2 and 3 starts from 2's)
            for t in self.params + self.buffers:
                dist.broadcast(t.data, src=first, group=group)
        with torch.no_grad():
            self.outer = [p.detach().float().clone() for p in self.params]
        self.momentum = [torch.zeros_like(o) for o in self.outer]
        self.numel = sum(o.numel() for o in self.outer)
        self.error_flat = self.outer[0].new_zeros(self.numel if self.error_feedback else 0)
        self.error = self._split(self.error_flat, self.outer) if self.error_feedback else []
        # the groups that share one scale: blocks of scale_block elements inside each tensor (or whole tensors)
        sizes = []
        for t in self.outer:
            block = scale_block or t.numel()
            sizes += [min(block, t.numel() - i) for i in range(0, t.numel(), block)]
        self._scale_groups = torch.tensor(sizes, dtype=torch.int64, device=self.outer[0].device)

    @property
    def world_size(self) -> int:
        return 1 if self.topology is None else self.topology.world_size

    # ------------------------------------------------------------------------------------------------ the loop
    def step(self) -> bool:
        """Count one inner step; on every ``local_steps``-th, exchange and take the outer step. Returns whether it
        did."""
        self.inner_steps += 1
        self.stats.fp32_allreduce_bytes += self._fp32_bytes()  # what DDP would have sent for this step
        if self.inner_steps % self.local_steps:
            return False
        self.sync()
        return True

    def finish(self) -> bool:
        """Exchange a partial round (inner steps since the last outer step), if any; returns whether it did."""
        if self.inner_steps % self.local_steps == 0:
            return False
        self.sync()
        return True

    def __enter__(self) -> LocalSteps:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            self.finish()

    def _fp32_bytes(self) -> int:
        return fp32_allreduce_bytes(self.numel, self.world_size)

    @torch.no_grad()
    def sync(self) -> None:
        """The outer step now: exchange the pseudo-gradients, step ``θ_outer``, and put it into every rank's model."""
        g = self._exchange([o - p.float() for o, p in zip(self.outer, self.params)])
        mu, lr = self.outer_momentum, self.outer_lr
        for o, m, gi, p in zip(self.outer, self.momentum, g, self.params):
            m.mul_(mu).add_(gi)
            o.sub_(gi.add(m, alpha=mu), alpha=lr)  # Nesterov, as torch.optim.SGD(nesterov=True)
            p.copy_(o)
        self._average_buffers()
        self.outer_steps += 1

    def _exchange(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        n = self.world_size
        if n == 1:
            return delta
        wire = Wire(self.topology, self.stats)
        if self.exchange == "fp32":
            flat = torch.cat([d.reshape(-1) for d in delta])
            _, work = wire.all_reduce_sum(flat, "world", per_peer=2 * 4 * flat.numel() / n)
            work.wait()
            return self._split(flat.div_(n), delta)
        e = torch.cat([d.reshape(-1) for d in delta])
        if self.error:
            e.add_(self.error_flat)
        lengths = self._scale_groups
        if self.encoding == "sign":  # the ranks' mean of mean|e| per group
            local = torch.segment_reduce(e.abs(), "mean", lengths=lengths)
            scale = wire.all_gather_sync(local, "world").view(n, -1).sum(0).div_(n)
        else:  # the largest |e| of the group on any rank
            local = torch.segment_reduce(e.abs(), "max", lengths=lengths)
            scale = wire.all_gather_sync(local, "world").view(n, -1).amax(0)
        scale = scale.repeat_interleave(lengths, output_size=e.numel())
        u = torch.sign(e) if self.encoding == "sign" else e / scale.clamp_min(torch.finfo(e.dtype).tiny)
        keys = BitKeys.single(self.seed, self.outer_steps, u.numel())
        if self.error:  # what this rank could not send, sent later: e minus its own vote, scaled
            torch.sub(e, own_votes(u, topology=self.topology, keys=keys).mul_(scale), out=self.error_flat)
        d = onebit_all_reduce(u, topology=self.topology, method=self.comm_settings, keys=keys, stats=self.stats, out=u)
        self.stats.fp32_allreduce_bytes -= self._fp32_bytes()  # counted per inner step instead
        return self._split(d.mul_(scale), delta)

    @staticmethod
    def _split(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
        return [c.view_as(t) for c, t in zip(flat.split([t.numel() for t in like]), like)]

    def _average_buffers(self) -> None:
        if self.world_size == 1 or not self.buffers:
            return
        flat = torch.cat([b.detach().float().reshape(-1) for b in self.buffers])
        mean = Wire(self.topology, self.stats).all_gather_sync(flat, "world").view(self.world_size, -1).sum(0)
        for b, m in zip(self.buffers, self._split(mean.div_(self.world_size), self.buffers)):
            b.copy_(m)

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """This rank's state: the round's position, ``θ_outer``, the outer momentum, the error buffers, this rank's
        own weights and buffers (they differ between outer steps) and the inner optimizer's state."""
        return {
            "local_steps": self.local_steps,
            "exchange": self.exchange,
            "encoding": self.encoding,
            "scale_block": self.scale_block,
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "outer": [o.clone() for o in self.outer],
            "momentum": [m.clone() for m in self.momentum],
            "error": [e.clone() for e in self.error],
            "params": [p.detach().clone() for p in self.params],
            "buffers": [b.detach().clone() for b in self.buffers],
            "optimizer": self.inner_optimizer.state_dict(),
        }

    def check_state_dict(self, state: dict) -> None:
        """Raise ``ValueError`` (changing nothing) unless ``state`` is a :meth:`state_dict` of this set-up."""
        missing = [k for k in (*_SETTINGS, *_TENSORS, "inner_steps", "outer_steps", "optimizer") if k not in state]
        if missing:
            raise ValueError(f"Not a LocalSteps state: missing {', '.join(missing)}.")
        for name in _SETTINGS:
            if state[name] != getattr(self, name):
                what = f"The checkpoint was trained with {name}={state[name]!r}, this run has {getattr(self, name)!r}"
                raise ValueError(explain(what, f"resume with {name}={state[name]!r} (the round it saved runs on)"))
        for name in _TENSORS:
            shapes = [tuple(t.shape) for t in state[name]], [tuple(t.shape) for t in getattr(self, name)]
            if shapes[0] != shapes[1]:
                raise ValueError(f"LocalSteps state: its {name} have shapes {shapes[0]}, this model's {shapes[1]}.")

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (checked first: a state that does not fit changes nothing)."""
        self.check_state_dict(state)
        self.inner_optimizer.load_state_dict(state["optimizer"])
        for name in _TENSORS:
            for t, saved in zip(getattr(self, name), state[name]):
                t.copy_(saved)
        self.inner_steps, self.outer_steps = int(state["inner_steps"]), int(state["outer_steps"])

    load_own_state_dict = load_state_dict  # the name birder_hf.checkpoint's per-rank loaders call
