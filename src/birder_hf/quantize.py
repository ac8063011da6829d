"""Binary randomization (the 1-bit quantizer of Birder), counter-based random bits and bit packing.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB

Binary randomization maps ``u`` in ``[-1, 1]`` to ``q`` in ``{-1, +1}`` with

.. math::
    P(q_j = +1) = (1 + u_j) / 2, \\qquad E[q_j] = u_j .

Our reconstruction (the paper's code was not available to us) draws the randomness from a
*counter-based* generator: element ``j`` of a tensor identified by ``key`` gets the 32-bit hash
``h(key, j)``, never a value consumed from a stream in order. The bits therefore do not depend on how
a tensor is split into DDP buckets, shards or chunks, which makes resume exact and lets any rank
re-create any other rank's draw. The 24 high bits of the hash give an integer ``r`` uniform on
``[-2^23, 2^23)``, and

.. math::
    q_j = +1 \\iff r < u_j \\cdot 2^{23} .

Both sides are exact in float32, so every device and the float64 reference agree bit for bit.
``P(q_j = +1) = (\\lceil u_j 2^{23} \\rceil + 2^{23}) / 2^{24}``: the resolution is ``2^{-24}`` and the
bias ``E[q_j] - u_j`` lies in ``[0, 2^{-23})``. The comparison is made in float32, which also clamps: ``u >= 1``
(``+inf`` too) always gives +1, ``u <= -1`` always -1, NaN -1; no value makes the threshold overflow.

**Antithetic pairs** (our extension; :func:`antithetic`). The voters of one draw (the ranks of a 1-bit all-reduce,
or its nodes) draw in pairs: members ``2 i`` and ``2 i + 1`` use pair ``i``'s key, hence the same ``r`` at every
element, and the odd member reflects it, ``r -> -1 - r``, a bijection of ``[-2^23, 2^23)``: each member's vote
keeps exactly the law above. With thresholds ``t = \\lceil u 2^{23} \\rceil`` the pair votes ``+1`` together iff
``-t_b <= r < t_a`` and ``-1`` together iff ``t_a <= r < -t_b``, so, writing ``u`` for ``t / 2^{23}``,

.. math::
    E[q_a q_b] = |u_a + u_b| - 1, \\qquad
    \\mathrm{Cov}(q_a, q_b) = |u_a + u_b| - 1 - u_a u_b \\le 0

(``(1 + u_a)(1 + u_b) >= 0`` and ``(1 - u_a)(1 - u_b) >= 0``), and ``Var(q_a + q_b) = |s| (2 - |s|)`` with
``s = u_a + u_b``, never more than the independent draws' ``2 - u_a^2 - u_b^2``. At ``u_a = u_b = 0`` the two votes
are ``+1`` iff ``r < 0`` and ``+1`` iff ``r >= 0``: they cancel exactly. (Also: ``q_a`` is non-increasing and ``q_b``
non-decreasing in the shared ``r``, which is what ``birder_hf.collectives`` uses for means of means.)

Bits are packed little-endian, 8 to a byte: bit ``k`` of byte ``i`` holds element ``8 i + k``
(``True`` = +1), and the last byte is padded with zeros.

This module never imports ``torch.distributed``.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Sequence

import torch

__all__ = [
    "binary_randomize",
    "pack_bits",
    "unpack_bits",
    "quantize_bits",
    "quantize_pack",
    "BitKeys",
    "antithetic",
    "set_codec_compile",
]

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF

# Stages of the 1-bit all-reduce; each draws from its own part of the key space.
STAGE_WORKER = 0  # a worker quantizes its own u
STAGE_SHARD = 1  # the owner of a shard re-quantizes the mean of the votes it received
STAGE_NODE = 2  # hierarchical: a node re-quantizes its node-level mean
STAGE_INTER_SHARD = 3  # hierarchical + scatter_gather: the inter-node shard owner re-quantizes


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def derive_key(*words: int) -> tuple[int, int]:
    """Mix integer words (seed, step, parameter, stage, rank, ...) into a key of two 32-bit words."""
    x = 0x243F6A8885A308D3
    for w in words:
        x = _splitmix64(x ^ (int(w) & _M64))
    return x & _M32, x >> 32


def _to_i32(x: int) -> int:
    x &= _M32
    return x - (1 << 32) if x >= (1 << 31) else x


def _hash32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit xorshift-multiply finalizer on int32 tensors. Multiplication wraps modulo 2^32 and the
    # masks turn arithmetic right shifts into logical ones, so this is exactly the uint32 hash.
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x21F0AAAD
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * 0x735A2D97
    return x ^ ((x >> 15) & 0x1FFFF)


def _int24_at(idx: torch.Tensor, params: torch.Tensor, reflect: bool = False) -> torch.Tensor:
    # params = [k1, k2, offset, ...] as int32; two hash rounds of the int32 counters ``idx`` (offset already
    # added, modulo 2^32) keyed by both key words. Returns int32 r, uniform on [-2^23, 2^23) (arithmetic >> 8),
    # or its reflection -1 - r (= ~r, the same range). ``reflect`` is a Python bool, so a compiled kernel holds
    # a constant (one variant per value; a rank only ever uses one): a flip word read from ``params`` made the
    # compiled CPU kernel ~5x slower (it stopped vectorizing).
    r = _hash32(_hash32(idx ^ params[0]) ^ params[1]) >> 8
    return ~r if reflect else r


def _int24(numel: int, params: torch.Tensor, device, reflect: bool = False) -> torch.Tensor:
    return _int24_at(torch.arange(numel, dtype=torch.int32, device=device) + params[2], params, reflect)


def _int32_words(words: list[int], device) -> torch.Tensor:
    # A few int32 words on ``device``. ``torch.tensor(words, device="cuda")`` copies from pageable memory and
    # synchronizes the stream: once per parameter per step, that would stall the CPU behind the GPU in the
    # middle of backward. Through pinned memory the copy is asynchronous (the host allocator keeps the block
    # until the copy has run).
    t = torch.tensor(words, dtype=torch.int32)
    if device is None or torch.device(device).type == "cpu":
        return t
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _key_params(key: tuple[int, int], offset: int, device, *extra: int) -> torch.Tensor:
    return _int32_words([_to_i32(key[0]), _to_i32(key[1]), _to_i32(offset), *extra], device)


def random_int24(numel: int, key: tuple[int, int], offset: int = 0, device=None, *, reflect: bool = False):
    """The random integers ``r`` in ``[-2^23, 2^23)`` (int32) for counters ``offset .. offset+numel-1``.

    ``reflect=True`` gives ``-1 - r`` instead: the antithetic partner's draw (same range, same uniform law).
    """
    return _int24(numel, _key_params(key, offset, device), device, reflect)


def _below(r: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    # 1 iff r < u * 2^23 (float32 u), as int32 0/1. Both sides are exact in float32 (|r| <= 2^23, u * 2^23 is a
    # power-of-two scaling), and for the integer r this is r < ceil(u * 2^23). The float comparison also clamps:
    # u >= 1 (+inf too) always gives 1, u <= -1 always 0, NaN always 0; nothing overflows (an int32 threshold
    # did for |u| >= 256). It compiles to a faster kernel than the integer form (benchmarks/codec.py).
    return (r.to(torch.float32) < u * 8388608.0).to(torch.int32)  # 2^23


def _bits_impl(u: torch.Tensor, params: torch.Tensor, reflect: bool = False) -> torch.Tensor:
    u = u.reshape(-1).to(torch.float32)
    return _below(_int24(u.numel(), params, u.device, reflect), u)


def _pack_impl(bits: torch.Tensor) -> torch.Tensor:
    b = bits.reshape(-1, 8).to(torch.int32)
    out = b[:, 0]
    for k in range(1, 8):
        out = out | (b[:, k] << k)
    return out.to(torch.uint8)


def _quantize_pack_impl(u: torch.Tensor, params: torch.Tensor, reflect: bool = False) -> torch.Tensor:
    return _pack_impl(_bits_impl(u, params, reflect))


def _quantize_bits_impl(u: torch.Tensor, params: torch.Tensor, reflect: bool = False) -> torch.Tensor:
    return _bits_impl(u, params, reflect).to(torch.bool)


def _unpack_impl(packed: torch.Tensor) -> torch.Tensor:
    # uint8 0/1 (viewed as bool by the caller): compiled bool stores are several times slower here
    b = packed.reshape(-1, 1).to(torch.int32)
    shifts = torch.arange(8, dtype=torch.int32, device=packed.device)
    return ((b >> shifts) & 1).reshape(-1).to(torch.uint8)


def _vote_mean(count: torch.Tensor, m: torch.Tensor, dtype: torch.dtype, work: torch.dtype | None = None):
    # (2 count - m) / m for m +-1 votes, correctly rounded to ``dtype`` (float32 or float64) on every device. The CPU
    # divides by IEEE rules (eager, and inductor's C++ kernels); Triton's float32 division is approximate (up to
    # 2 ulp), so elsewhere the quotient is taken in float64 and rounded once: for integers below 2^24 that is the
    # same correctly rounded float32 (double rounding is harmless with 53 >= 2 * 24 + 2 bits). Float64 halves the
    # CPU kernel's speed, hence only off the CPU; tests/test_quantize.py checks both ``work`` forms against exact
    # rationals for every count of m <= 64 votes. m is a tensor: inductor would turn a division by a constant
    # into a multiplication by its reciprocal, which is not bitwise the same.
    if work is None:
        work = dtype if count.device.type == "cpu" else torch.float64
    return ((2 * count - m).to(work) / m.to(work)).to(dtype)


def _pair_bits(row: torch.Tensor) -> torch.Tensor:
    # bytes (2 S,) -> 0/1 int32 (S, 16), element 16 i + k = bit k of bytes 2i, 2i+1: rows of 16 fill the
    # 16-lane vectors of the compiled kernel (rows of 8 ran at half speed)
    pairs = row.view(-1, 2).to(torch.int32)
    word = pairs[:, 0] | (pairs[:, 1] << 8)
    return (word.view(-1, 1) >> torch.arange(16, dtype=torch.int32, device=row.device)) & 1


def _mean_out(out: torch.Tensor, count: torch.Tensor, m: torch.Tensor) -> None:
    # exact in the work dtype (float64 for a float64 out, else float32), then rounded to out's dtype
    work = torch.float64 if out.dtype == torch.float64 else torch.float32
    out.copy_(_vote_mean(count, m, work).view(-1))


def _votes_mean_impl(rows: torch.Tensor, m: torch.Tensor, out: torch.Tensor) -> None:
    # out = mean of the m packed +-1 vote rows (m, P) over their first out.numel() (a multiple of 16) bits
    rows = rows[:, : out.numel() // 8]
    _mean_out(out, sum(_pair_bits(rows[r]) for r in range(rows.shape[0])), m)


def _digits_mean_impl(planes: torch.Tensor, m: torch.Tensor, out: torch.Tensor) -> None:
    # the same, for vote counts given by their binary digits: plane j of (B, P) holds bit j of every count
    planes = planes[:, : out.numel() // 8]
    _mean_out(out, sum(_pair_bits(planes[j]) << j for j in range(planes.shape[0])), m)


def _requantize_pack_impl(rows: torch.Tensor, params: torch.Tensor, reflect: bool = False) -> torch.Tensor:
    # float32 mean of the m vote rows (m, P) (params[3] = m), then quantize_pack: few ops, for eager calls
    count = sum(_unpack_impl(rows[r]).to(torch.int32) for r in range(rows.shape[0]))
    return _quantize_pack_impl(_vote_mean(count, params[3], torch.float32), params, reflect)


def _requantize_pack_fused(rows: torch.Tensor, params: torch.Tensor, reflect: bool = False) -> torch.Tensor:
    # the same in one compiled pass: bit k of byte i is element 8 i + k, whose mean and counter are computed
    # in place (nothing unpacked); eagerly it would launch ~8 (3 m + 12) small ops
    idx = torch.arange(rows.shape[1], dtype=torch.int32, device=rows.device) * 8 + params[2]
    rows = rows.to(torch.int32)
    out = 0
    for k in range(8):
        count = sum((rows[r] >> k) & 1 for r in range(rows.shape[0]))
        mean = _vote_mean(count, params[3], torch.float32)
        out = out | (_below(_int24_at(idx + k, params, reflect), mean) << k)
    return out.to(torch.uint8)


class _Codec:
    """Eager kernels, replaced by ``torch.compile``-d ones (of ``_FUSED[name]`` if given) when they can be built.

    Compiled and eager kernels are bitwise identical (tested); compiling fuses hash, threshold and
    packing into one pass near memory bandwidth (``benchmarks/codec.py``).
    """

    _EAGER = {
        "quantize_pack": _quantize_pack_impl,
        "bits": _quantize_bits_impl,
        "pack": _pack_impl,
        "unpack": _unpack_impl,
        "votes_mean": _votes_mean_impl,
        "digits_mean": _digits_mean_impl,
        "requantize_pack": _requantize_pack_impl,
    }
    _FUSED = {"requantize_pack": _requantize_pack_fused}

    def __init__(self):
        # BIRDER_HF_CODEC_COMPILE=0: eager kernels from the start (no compiler, or short-lived processes such as a
        # test suite's ranks, where the one-off compile per process costs more than it saves)
        self.enabled = os.environ.get("BIRDER_HF_CODEC_COMPILE", "1") != "0"
        self._compiled: dict[str, object] = {}
        self._failed: set[str] = set()  # kernels that failed to compile (too many variants, no compiler, ...)
        self._lock = threading.Lock()

    def get(self, name: str):
        if not self.enabled or name in self._failed:
            return self._EAGER[name]
        fn = self._compiled.get(name)
        if fn is None:
            with self._lock:
                fn = self._compiled.get(name)
                if fn is None:
                    fn = torch.compile(self._FUSED.get(name, self._EAGER[name]), dynamic=True, fullgraph=True)
                    self._compiled[name] = fn
        return fn

    def __call__(self, name: str, *args):
        fn = self.get(name)
        if fn is self._EAGER[name]:
            return fn(*args)
        try:
            # grad mode is thread-local and part of a compiled kernel's guards: the codec runs in the caller's thread
            # (the DDP hook inside backward, step() under no_grad) and on gloo's callback thread, so without this a
            # kernel recompiles (a second or more) whenever it first runs in the other mode, at a step set by timing
            with torch.no_grad():
                return fn(*args)
        except Exception as exc:  # no C++ compiler, unsupported device, recompile limit, ...
            if not self._failed:  # warn once
                message = f"birder_hf: torch.compile of codec kernel {name!r} failed ({type(exc).__name__}: {exc}); "
                message += "falling back to eager kernels (the same bits). set_codec_compile(False) silences this."
                warnings.warn(message, RuntimeWarning, stacklevel=3)
            self._failed.add(name)
            return self._EAGER[name](*args)


_codec = _Codec()


def _forget_compile_threads_after_fork() -> None:
    # torch's inductor compiles CPU kernels on a thread pool (``AsyncCompile.pool``, made once per process) and resets
    # only its process pool in a forked child: a child inherits the pool object without its threads, and the first
    # kernel it compiles waits forever (``CppCodeCache.load_async``). The codec compiles in the caller's process, so
    # a program that forks afterwards (test runners, multiprocessing ranks) would hang; the child starts a new pool.
    async_compile = sys.modules.get("torch._inductor.async_compile")
    pool = getattr(getattr(async_compile, "AsyncCompile", None), "pool", None)
    if pool is not None and hasattr(pool, "cache_clear"):
        pool.cache_clear()


if hasattr(os, "register_at_fork"):  # not on Windows, which cannot fork
    os.register_at_fork(after_in_child=_forget_compile_threads_after_fork)

# Below this many elements the eager kernels run (sizes 0 and 1 would make a compiled kernel specialize and
# recompile). From here up a compiled call is the faster: ~20 us against ~150 us for the ~20 eager ops at 16 to 8192
# elements (``benchmarks/codec.py --small``), which a model's many biases and norms pay on every step.
_MIN_COMPILED_NUMEL = 16


def set_codec_compile(enabled: bool) -> bool:
    """Use ``torch.compile``-d codec kernels (default) or eager ones (no compiler needed; bitwise the same bits).

    The environment variable ``BIRDER_HF_CODEC_COMPILE=0`` sets the default to eager. Returns the previous setting
    (to restore it)."""
    before, _codec.enabled = _codec.enabled, bool(enabled)
    return before


def run_kernel(name: str, numel: int, *args):
    """Run codec kernel ``name`` (or one added by :func:`register_kernel`) on ``numel`` elements: compiled, or eager
    below ``_MIN_COMPILED_NUMEL`` elements, or when compiling is off or failed (``set_codec_compile``)."""
    if numel < _MIN_COMPILED_NUMEL:
        return _Codec._EAGER[name](*args)
    return _codec(name, *args)


def register_kernel(name: str, eager) -> None:
    """Add a kernel of another module (the optimizer's encode) to the codec's: compiled like them, with ``eager``
    as its reference and fallback (it must give the same bits compiled: no product summed without rounding)."""
    _Codec._EAGER[name] = eager


def quantize_bits(u: torch.Tensor, key: tuple[int, int], offset: int = 0, *, reflect: bool = False) -> torch.Tensor:
    """Binary randomization of ``u`` (any shape) as a flat bool tensor (``True`` = +1).

    ``u`` lies in ``[-1, 1]`` (Birder's encoder guarantees it); values outside are clamped by the rule itself
    (``u >= 1``, ``+inf`` included, always gives +1, ``u <= -1`` always -1) and NaN gives -1, in the same pass.
    ``offset`` is the counter of ``u``'s first element; ``reflect`` draws with ``-1 - r`` (see :func:`antithetic`).
    """
    return run_kernel("bits", u.numel(), u, _key_params(key, offset, u.device), reflect)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool (or 0/1) tensor of any length into ``ceil(n / 8)`` uint8, little-endian."""
    bits = bits.reshape(-1)
    n = bits.numel()
    full = n - n % 8
    parts = []
    if full:
        parts.append(run_kernel("pack", full, bits[:full].bool()))
    if n % 8:
        tail = torch.zeros(8, dtype=torch.bool, device=bits.device)
        tail[: n % 8] = bits[full:].bool()
        parts.append(_pack_impl(tail))
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=bits.device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` bits of ``packed`` as a bool tensor."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_bits expects a uint8 tensor, got {packed.dtype}")
    if not 0 <= numel <= 8 * packed.numel():
        raise ValueError(f"numel={numel} does not fit in {packed.numel()} packed bytes (at most {8 * packed.numel()})")
    return run_kernel("unpack", numel, packed.reshape(-1))[:numel].view(torch.bool)


def quantize_pack(u: torch.Tensor, key: tuple[int, int], offset: int = 0, *, reflect: bool = False) -> torch.Tensor:
    """Binary randomization of ``u`` fused with :func:`pack_bits`: ``ceil(u.numel() / 8)`` uint8.

    Same contract as :func:`quantize_bits`; one pass over ``u`` when compiled.
    """
    u = u.reshape(-1)
    n = u.numel()
    full = n - n % 8
    if n % 8 == 0:
        return run_kernel("quantize_pack", n, u, _key_params(key, offset, u.device), reflect)
    head = run_kernel("quantize_pack", full, u[:full], _key_params(key, offset, u.device), reflect) if full else None
    tail = pack_bits(quantize_bits(u[full:], key, offset + full, reflect=reflect))
    return tail if head is None else torch.cat([head, tail])


def _mean_of_counts(name: str, out: torch.Tensor, rows: torch.Tensor, m: int) -> torch.Tensor:
    n = out.numel()
    if not n <= 8 * rows.shape[1]:
        raise ValueError(f"out has {n} elements, the packed rows describe {8 * rows.shape[1]}")
    mt = _int32_words([m], out.device)
    head = n // 16 * 16  # the kernels write whole 16-element groups
    if head:
        run_kernel(name, head, rows, mt, out[:head])
    if head < n:  # the last < 16 elements, from the last bytes padded to a pair
        tail = rows.new_zeros(rows.shape[0], 2)
        last = rows[:, head // 8 : head // 8 + 2]
        tail[:, : last.shape[1]] = last
        full = out.new_empty(16)
        _Codec._EAGER[name](tail, mt, full)
        out[head:] = full[: n - head]
    return out


def votes_mean_(out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[i] = (2 c_i - m) / m``, the exact mean of the ``m`` packed ±1 votes ``rows`` ``(m, P)`` uint8.

    ``c_i`` counts the rows whose bit ``i`` is set, for ``i < out.numel() <= 8 P``; ``m = 1`` gives the signs.
    The division is rounded once in float32 (float64 for a float64 ``out``), then to ``out``'s dtype: every
    device gives the same bits. One pass when compiled; nothing is unpacked.
    """
    return _mean_of_counts("votes_mean", out, rows, rows.shape[0])


def digits_mean_(out: torch.Tensor, planes: torch.Tensor, m: int) -> torch.Tensor:
    """:func:`votes_mean_` for counts of ``m`` votes given by their binary digits: ``planes`` ``(B, P)`` uint8,
    packed like the votes, plane ``j`` holding bit ``j`` of every count (``B >= m.bit_length()``)."""
    return _mean_of_counts("digits_mean", out, planes, m)


def requantize_pack(rows: torch.Tensor, key: tuple[int, int], offset: int = 0, *, reflect: bool = False):
    """Binary randomization of the mean of ``m`` packed ±1 vote rows ``(m, P)``, packed: ``P`` uint8.

    Bitwise equal to ``quantize_pack(v, key, offset, reflect=reflect)`` with ``v`` the float32 mean of
    :func:`votes_mean_`, in one pass over the votes when compiled.
    """
    params = _key_params(key, offset, rows.device, rows.shape[0])
    return run_kernel("requantize_pack", 8 * rows.shape[1], rows, params, reflect)


def binary_randomize(u: torch.Tensor, generator: torch.Generator | int | tuple[int, int] | None = None):
    """Return ``q`` in ``{-1, +1}`` (same shape and dtype as ``u``) with ``E[q] = u`` for ``u`` in [-1, 1].

    Args:
        u (`torch.Tensor`): values in ``[-1, 1]``; values outside are clamped by the rule (``u >= 1``
            always gives +1, ``u <= -1`` always -1) and NaN gives -1 (as :func:`quantize_bits`).
        generator (`torch.Generator`, `int` or key, *optional*): where the key of the counter-based
            draw comes from: a ``torch.Generator`` (two 32-bit words are drawn from it), an integer
            seed, a key from :func:`derive_key`, or ``None`` for torch's default generator.

    Returns:
        `torch.Tensor`: ``q`` with ``P(q = +1) = (1 + u) / 2`` up to the ``2^-24`` resolution above.

    Example::

        >>> u = torch.full((100_000,), 0.5)
        >>> q = binary_randomize(u, generator=0)
        >>> abs(q.mean().item() - 0.5) < 0.01
        True
    """
    if isinstance(generator, tuple):
        key = generator
    elif isinstance(generator, int):
        key = derive_key(generator)
    else:
        words = torch.randint(0, 1 << 31, (2,), generator=generator, dtype=torch.int64)
        key = derive_key(int(words[0]), int(words[1]))
    bits = quantize_bits(u.detach(), key)
    one = torch.ones((), dtype=u.dtype, device=u.device)
    return torch.where(bits, one, -one).reshape(u.shape)


def antithetic(member: int) -> tuple[int, bool]:
    """``(who, reflect)`` of a drawing ``member`` (a rank, or a node): members ``2 i`` and ``2 i + 1`` form pair
    ``i``, share its key and the odd one reflects the draw (``r -> -1 - r``); a last, unpaired member draws alone.

    See the module docstring: each vote keeps its law exactly, and a pair's two votes never covary positively.
    """
    return member // 2, member % 2 == 1


class BitKeys:
    """Keys for a flat buffer made of consecutive segments, one per parameter.

    Element ``i`` of segment ``s`` gets counter ``segment_offsets[s] + i`` under the key
    ``derive_key(seed, step, segment_ids[s], stage, who)``, so its random bit does not depend on where
    the segment sits in a DDP bucket, a shard or a chunk. A segment that is a shard of a parameter (FSDP) gives
    the index of its first element in the flattened full parameter as its offset: element ``j`` of the parameter
    then draws from counter ``j`` whichever rank holds it. The two members of an antithetic pair
    (:func:`antithetic`) draw with the same ``who`` and one of them with ``reflect=True``.

    Args:
        seed (`int`): the optimizer's seed.
        step (`int` or `Sequence[int]`): the optimizer step the draw belongs to (or one per segment).
        segment_ids (`Sequence[int]`): a stable id per segment (the parameter's index in the optimizer).
        segment_sizes (`Sequence[int]`): the number of elements of each segment.
        segment_offsets (`Sequence[int]`, *optional*): the counter of each segment's first element (default 0).
    """

    __slots__ = ("seed", "steps", "ids", "starts", "offsets", "numel")

    def __init__(
        self,
        seed: int,
        step: int | Sequence[int],
        segment_ids: Sequence[int],
        segment_sizes: Sequence[int],
        segment_offsets: Sequence[int] | None = None,
    ):
        if len(segment_ids) != len(segment_sizes):
            raise ValueError("segment_ids and segment_sizes must have the same length")
        steps = [int(step)] * len(segment_ids) if isinstance(step, int) else [int(s) for s in step]
        if len(steps) != len(segment_ids):
            raise ValueError("give one step, or one step per segment")
        offsets = [0] * len(segment_ids) if segment_offsets is None else [int(o) for o in segment_offsets]
        if len(offsets) != len(segment_ids) or any(o < 0 for o in offsets):
            raise ValueError("give one segment offset (>= 0) per segment, or none")
        self.seed, self.steps, self.offsets = int(seed), steps, offsets
        self.ids = [int(i) for i in segment_ids]
        starts, total = [], 0
        for size in segment_sizes:
            starts.append(total)
            total += int(size)
        self.starts = starts
        self.numel = total

    @classmethod
    def single(cls, seed: int, step: int, numel: int, segment_id: int = 0) -> BitKeys:
        return cls(seed, step, [segment_id], [numel])

    def key(self, segment: int, stage: int, who: int) -> tuple[int, int]:
        """The key of segment ``segment`` at ``stage`` drawn by ``who`` (a shard owner: 0; workers and nodes: their
        antithetic pair, :func:`antithetic`)."""
        return derive_key(self.seed, self.steps[segment], self.ids[segment], stage, who)

    def _pieces(self, start: int, stop: int):
        # (segment, its counter at ``start``-relative element lo, lo, hi) for every overlap with [start, stop);
        # the last segment runs on past self.numel (padding continues its counters)
        ends = self.starts[1:] + [max(stop, self.numel)]
        for s, (a, b) in enumerate(zip(self.starts, ends)):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                yield s, self.offsets[s] + lo - a, lo - start, hi - start

    def _pack(self, numel: int, start: int, stage: int, who: int, encode, device) -> torch.Tensor:
        # packed bits of elements [start, start + numel): encode(a, b, key, counter) packs elements [a, b)
        # (whole bytes but the buffer's last) under one key; a byte shared by two segments is OR-ed together
        pieces = list(self._pieces(start, start + numel))
        if len(pieces) == 1:
            s, off, _, _ = pieces[0]
            return encode(0, numel, self.key(s, stage, who), off)
        out = torch.zeros(-(-numel // 8), dtype=torch.uint8, device=device)
        for s, off, lo, hi in pieces:
            a, b = lo - lo % 8, min(-(-hi // 8) * 8, numel)
            part = encode(a, b, self.key(s, stage, who), off - lo % 8)
            if lo % 8:  # drop the previous segment's elements of the first byte
                part[:1] &= (0xFF << (lo % 8)) & 0xFF
            if hi % 8 and hi < numel:  # and the next one's of the last byte
                part[-1:] &= (1 << (hi % 8)) - 1
            out[a // 8 : a // 8 + part.numel()] |= part
        return out

    def quantize_pack(self, u: torch.Tensor, start: int, stage: int, who: int, *, reflect: bool = False):
        """Packed bits of ``u``, the flat range ``[start, start + u.numel())`` of the buffer.

        ``reflect`` draws with ``-1 - r`` (the odd member of an antithetic pair: :func:`antithetic`). Elements past
        ``self.numel`` (padding) are quantized under the last segment's key continued, which keeps them
        deterministic; callers give padding ``u = -1`` so its bit is always 0.
        """
        u = u.reshape(-1)

        def encode(a, b, key, off):  # elements [a, b) of u under one key
            return quantize_pack(u[a:b], key, off, reflect=reflect)

        return self._pack(u.numel(), start, stage, who, encode, u.device)

    def requantize_pack(self, rows: torch.Tensor, start: int, stage: int, who: int, *, reflect: bool = False):
        """:func:`requantize_pack` of the vote rows ``(m, P)`` of elements ``[start, start + 8 P)``, per segment.

        Bitwise equal to ``self.quantize_pack(v, start, stage, who, reflect=reflect)`` for ``v`` the float32 mean
        of the votes.
        """

        def encode(a, b, key, off):  # elements [a, b) of the votes under one key
            return requantize_pack(rows[:, a // 8 : b // 8], key, off, reflect=reflect)

        return self._pack(8 * rows.shape[1], start, stage, who, encode, rows.device)
