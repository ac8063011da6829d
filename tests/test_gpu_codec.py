"""The 1-bit codec on CUDA gives the same bits as on the CPU, compiled (Triton) and eager.

The codec's draws are counter-based (``birder_hf.quantize``): a hash of the element's index and a key, compared
with an integer threshold, so that every device gives the same bits. The decode kernels promise the same: the vote
mean ``(2c - m) / m`` is one division rounded once. Reference: the CPU's eager kernels (which the CPU suite checks
against its compiled ones and against Python integer arithmetic).

Sizes: not divisible by 8 (tails), above ``2^16`` and above ``2^24`` (compiled kernels run from 16 elements up).
Vote counts ``m`` of 3 and 5 make the division inexact; ``m`` of 1, 2 and 4 are exact in any rounding. The division
itself (``_vote_mean``, compiled as the kernels compile it) is checked for every count of ``m <= 64`` votes: Triton's
float32 division is approximate (2 ulp), so off the CPU the kernels divide in float64 and round once.
"""

import warnings

import pytest
import torch
from _cuda import cpu_threads, gpu

from birder_hf import quantize as Q

SIZES = [13, 1001, (1 << 16) + 3, (1 << 24) + 5]
OFFSET = 77  # counters of u's first element; the kernels add it to every index
VOTES = (1, 3, 4, 5)  # rows averaged by votes_mean_ (allgather's decode), into float32 and bfloat16
REQUANTIZE = (2, 3)  # rows re-quantized by requantize_pack (a shard owner's draw)


def _segments(n):
    # three parameters whose boundaries are not byte-aligned (or one, for tiny n)
    if n < 16:
        return [n]
    a, b = n // 3 + 1, n // 5 + 3
    return [a, b, n - a - b]


def codec_results(device, n: int, compiled: bool) -> dict:
    """Every codec kernel on ``device`` for the same inputs (made on the CPU), moved back to the CPU."""
    before = Q.set_codec_compile(compiled)
    try:
        g = torch.Generator().manual_seed(n)
        u_cpu = torch.rand(n, generator=g, dtype=torch.float64).mul_(2).sub_(1).float()
        u_cpu[:3] = torch.tensor([-1.0, 1.0, 0.0])[: min(3, n)]  # the ends of the range, and a fair coin
        rows_cpu = torch.randint(0, 256, (max(VOTES + REQUANTIZE), -(-n // 8)), generator=g, dtype=torch.uint8)
        planes_cpu = torch.randint(0, 256, (2, -(-n // 8)), generator=g, dtype=torch.uint8)  # counts 0..3 of k = 3
        u, rows, planes = u_cpu.to(device), rows_cpu.to(device), planes_cpu.to(device)
        key = Q.derive_key(1234, n)
        out = {}
        out["quantize_pack"] = Q.quantize_pack(u, key, OFFSET)
        out["quantize_pack bf16 u"] = Q.quantize_pack(u.bfloat16(), key)
        out["quantize_bits"] = Q.quantize_bits(u, key, OFFSET)
        out["pack_bits"] = Q.pack_bits(out["quantize_bits"])
        out["unpack_bits"] = Q.unpack_bits(out["quantize_pack"], n)
        out["binary_randomize"] = Q.binary_randomize(u, generator=9)
        for m in VOTES:
            for dtype in (torch.float32, torch.bfloat16):
                mean = torch.empty(n, dtype=dtype, device=device)
                out[f"votes_mean_ m={m} {dtype}"] = Q.votes_mean_(mean, rows[:m])
        out["digits_mean_ k=3"] = Q.digits_mean_(torch.empty(n, device=device), planes, 3)
        for m in REQUANTIZE:
            out[f"requantize_pack m={m}"] = Q.requantize_pack(rows[:m], key, OFFSET)
        sizes = _segments(n)
        keys = Q.BitKeys(99, [5, 6, 7][: len(sizes)], [0, 4, 9][: len(sizes)], sizes)
        out["BitKeys.quantize_pack"] = keys.quantize_pack(u, 0, Q.STAGE_WORKER, 1)
        out["BitKeys.requantize_pack"] = keys.requantize_pack(rows[:3], 0, Q.STAGE_NODE, 2)
        out["BitKeys.quantize_pack reflect"] = keys.quantize_pack(u, 0, Q.STAGE_WORKER, 0, reflect=True)
        out["BitKeys.requantize_pack reflect"] = keys.requantize_pack(rows[:5], 0, Q.STAGE_NODE, 1, reflect=True)
        pairs = [(c, m) for m in range(1, 65) for c in range(m + 1)]
        count = torch.tensor([c for c, _ in pairs], dtype=torch.int32, device=device)
        m = torch.tensor([m for _, m in pairs], dtype=torch.int32, device=device)
        divide = torch.compile(Q._vote_mean, dynamic=True, fullgraph=True) if compiled else Q._vote_mean
        out["_vote_mean every count of m <= 64"] = divide(count, m, torch.float32)
        if device != "cpu":
            torch.cuda.synchronize()
        return {k: v.cpu() for k, v in out.items()}
    finally:
        Q.set_codec_compile(before)


_REFERENCE: dict[int, dict] = {}


def _reference(n):
    if n not in _REFERENCE:
        with cpu_threads():
            _REFERENCE[n] = codec_results("cpu", n, compiled=False)
    return _REFERENCE[n]


def _mismatches(ref: dict, got: dict) -> list[str]:
    bad = []
    for name, want in ref.items():
        have = got[name]
        if have.dtype != want.dtype or have.shape != want.shape:
            bad.append(f"{name}: {have.dtype}{tuple(have.shape)} != {want.dtype}{tuple(want.shape)}")
        elif not torch.equal(have, want):
            diff = (have != want).nonzero().flatten()
            i = int(diff[0])
            bad.append(
                f"{name}: {diff.numel()} elements differ, first at {i}: {have[i].item()!r} != {want[i].item()!r}"
            )
    return bad


@gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("n", SIZES)
def test_codec_on_cuda_is_bitwise_the_cpu_codec(n, compiled):
    with warnings.catch_warnings():
        # a compiled kernel that fails to build falls back to eager with a RuntimeWarning: make that a failure
        warnings.filterwarnings("error", message="birder_hf: torch.compile", category=RuntimeWarning)
        got = codec_results("cuda", n, compiled)
    assert _mismatches(_reference(n), got) == []


@gpu
def test_codec_bits_are_unbiased_on_cuda():
    # E[q] = u on the device itself: 4M draws of u = 0.3, mean within 5 standard errors (+ the 2^-23 bias bound)
    u = torch.full((1 << 22,), 0.3, device="cuda")
    q = Q.binary_randomize(u, generator=5)
    sd = (1 - 0.3**2) ** 0.5 / u.numel() ** 0.5
    assert abs(q.double().mean().item() - 0.3) <= 5 * sd + 2**-23


def test_codec_results_run_on_cpu():
    # CI (no GPU): the comparison's inputs and kernels are well formed; eager only, small sizes
    ref = codec_results("cpu", 1001, compiled=False)
    assert _mismatches(ref, codec_results("cpu", 1001, compiled=False)) == []
    assert ref["unpack_bits"].shape == (1001,) and ref["quantize_pack"].numel() == 126
    assert ref["votes_mean_ m=3 torch.float32"].abs().max() <= 1.0
    assert _mismatches(ref, {**ref, "quantize_pack": ref["quantize_pack"] ^ 1})[0].startswith("quantize_pack:")
