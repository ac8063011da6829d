"""A slow, paper-literal Birder used as the reference in tests (our reconstruction, see ``optim.py``).

Plain tensor arithmetic, one parameter at a time, no fused kernels: every line is one line of the
update rule. It draws its bits from the same counter-based generator as :class:`birder_hf.Birder`
(``random_int24``), so with the same seed both take the same random decisions. Where ``u`` is exactly 0 the
direction is 0 (no coin: a coordinate whose gradient has always been 0 moves by weight decay only). Where this
step's gradient is exactly 0: ``stale="keep"`` is the paper's literal update, ``"fade"`` decays m once more and sets
``u = 0`` where ``|u| < STALE_VOTE_MIN``, ``"lazy"`` sets ``u = 0`` (as ``Birder``'s ``stale``). ``beta2`` and
``grad_clip`` as ``Birder``'s: Adam's bias-corrected direction clipped to [-1, 1], and each gradient clipped to its
share of a global norm; ``error_feedback``: the vote's sign of ``u + e``, ``e`` the kept rounding error.
"""

from __future__ import annotations

import math

import torch

from .optim import DEFAULT_STALE, STALE_VOTE_MIN
from .quantize import STAGE_WORKER, derive_key, random_int24

__all__ = ["BirderReference"]


class BirderReference:
    """x <- x - lr * (Q(m / b) + wd * x), m and b EMAs of g and |g|, Q(0) = 0 (single process, rank 0); ``stale`` as
    in ``Birder``."""

    def __init__(
        self,
        params,
        lr=1e-3,
        beta=0.95,
        weight_decay=0.0,
        *,
        quantize=True,
        amsgrad=False,
        beta2=None,
        eps=1e-8,
        grad_clip=None,
        error_feedback=False,
        stale=DEFAULT_STALE,
        seed=0,
    ):
        self.params = list(params)
        self.lr, self.beta, self.wd = lr, beta, weight_decay
        self.beta2, self.eps, self.grad_clip, self.error_feedback = beta2, eps, grad_clip, error_feedback
        self.e = [torch.zeros_like(p) for p in self.params]
        self.quantize, self.amsgrad, self.stale, self.seed = quantize, amsgrad, stale, seed
        self.m = [torch.zeros_like(p) for p in self.params]
        self.b = [torch.zeros_like(p) for p in self.params]
        self.b_max = [torch.zeros_like(p) for p in self.params]
        self.t = [0 for _ in self.params]

    @torch.no_grad()
    def step(self):
        for i, x in enumerate(self.params):
            if x.grad is None:
                continue
            g = x.grad
            self.t[i] += 1
            if self.grad_clip is not None:  # its share of a global norm: ||g|| <= c sqrt(n / N)
                share = self.grad_clip * math.sqrt(g.numel() / sum(p.numel() for p in self.params))
                g = g * (share / torch.linalg.vector_norm(g)).clamp(max=1.0)
            self.m[i] = self.beta * self.m[i] + (1 - self.beta) * g
            if self.beta2 is None:
                self.b[i] = self.beta * self.b[i] + (1 - self.beta) * g.abs()
            else:  # b holds v, the EMA of g**2
                self.b[i] = self.beta2 * self.b[i] + (1 - self.beta2) * (g * g)
            if self.stale == "fade":  # a stale coordinate's m decays once more: its u shrinks by beta
                self.m[i] = torch.where(g == 0, self.m[i] * self.beta, self.m[i])
            b = self.b[i]
            if self.amsgrad:
                self.b_max[i] = torch.maximum(self.b_max[i], self.b[i])
                b = self.b_max[i]
            if self.beta2 is None:
                u = torch.where(b == 0, torch.zeros_like(b), self.m[i] / b)
            else:
                m_hat = self.m[i] / (1 - self.beta ** self.t[i])
                v_hat = b / (1 - self.beta2 ** self.t[i])
                u = (m_hat / (v_hat.sqrt() + self.eps)).clamp(-1, 1)
            if self.stale == "lazy":  # no gradient this step: no vote
                u = torch.where(g == 0, torch.zeros_like(u), u)
            elif self.stale == "fade":  # no gradient this step and a faded u: no vote
                u = torch.where((g == 0) & (u.abs() < STALE_VOTE_MIN), torch.zeros_like(u), u)
            if self.error_feedback:  # vote sign(u + e), keep the rounding error; no vote where u = 0
                s = u + self.e[i]
                q = torch.where(s >= 0, 1.0, -1.0).to(s.dtype)
                self.e[i] = torch.where(u == 0, self.e[i], s - q)
                u = torch.where(u == 0, 0.0, q).to(s.dtype)
            if self.quantize:
                key = derive_key(self.seed, self.t[i], i, STAGE_WORKER, 0)
                r = random_int24(u.numel(), key).view(u.shape).to(torch.float64)
                # P(q = +1) = (1 + u) / 2: q = +1 iff r < u * 2^23, r uniform on [-2^23, 2^23)
                d = torch.where(r < u.to(torch.float64) * 2.0**23, 1.0, -1.0).to(x.dtype)
                d = torch.where(u == 0, 0.0, d)  # u = 0: no move (unbiased too)
            else:
                d = u
            x.copy_(x - self.lr * (d + self.wd * x))
