"""The 1-bit codec: unbiasedness, bit packing, counter-based keys, compiled == eager."""

import math
import threading
from fractions import Fraction

import pytest
import torch
from _dist import run_distributed
from hypothesis import given, settings
from hypothesis import strategies as st

from birder_hf import quantize as Q


def _reference_int24(numel, key, offset=0):
    # Independent uint32 arithmetic on Python ints (the int32 kernels must match it bit for bit).
    M = 0xFFFFFFFF

    def h(x):
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & M
        x ^= x >> 15
        x = (x * 0x735A2D97) & M
        return x ^ (x >> 15)

    out = []
    for i in range(offset, offset + numel):
        x = h(h((i & M) ^ key[0]) ^ key[1])
        out.append((x >> 8) - (1 << 24) if x >= (1 << 31) else x >> 8)  # int32 arithmetic shift
    return torch.tensor(out, dtype=torch.int32)


def test_hash_matches_uint32_reference():
    key = Q.derive_key(7, 11)
    assert torch.equal(Q.random_int24(1000, key, offset=12345), _reference_int24(1000, key, offset=12345))
    r = Q.random_int24(200_000, key).to(torch.float64)
    assert r.min() >= -(2**23) and r.max() < 2**23
    # uniform: mean 0 +- 5 standard errors (sd of U[-2^23, 2^23) is 2^24 / sqrt(12))
    assert abs(r.mean().item()) < 5 * (2**24 / math.sqrt(12)) / math.sqrt(r.numel())


def test_reflected_draw_is_minus_one_minus_r():
    key = Q.derive_key(7, 11)
    ref = _reference_int24(1000, key, offset=12345)
    assert torch.equal(Q.random_int24(1000, key, offset=12345, reflect=True), -1 - ref)
    # the quantizer's rule on the reflected draw, against Python arithmetic on the reference integers
    u = torch.rand(1000) * 2 - 1
    u[:4] = torch.tensor([0.0, 1.0, -1.0, 2.0**-24])
    want = torch.tensor([(-1 - r) < x * 2**23 for r, x in zip(ref.tolist(), u.tolist())])
    assert torch.equal(Q.quantize_bits(u, key, offset=12345, reflect=True), want)
    assert torch.equal(Q.quantize_pack(u, key, 12345, reflect=True), Q.pack_bits(want))
    assert Q.antithetic(0) == (0, False) and Q.antithetic(1) == (0, True) and Q.antithetic(6) == (3, False)


def test_antithetic_pair_keeps_the_law_and_covaries_negatively():
    # pair votes share r, the odd one reflected: P(q = +1) unchanged, E[q_a q_b] = |u_a + u_b| - 1 (module
    # docstring); N = 60k elements per (u_a, u_b) (eager kernels), tolerance 5 standard errors (both statistics
    # lie in [-1, 1]; the covariance estimate has two such terms)
    n, key = 60_000, Q.derive_key(2, 3)
    for ua, ub in [(0.0, 0.0), (0.5, 0.5), (-0.3, 0.8), (0.9, -0.9), (-0.6, -0.2)]:
        qa = Q.binary_randomize(torch.full((n,), ua), generator=key).double()
        qb = Q.quantize_bits(torch.full((n,), ub), key, reflect=True).double() * 2 - 1
        se = 5 / math.sqrt(n)
        assert abs(qb.mean().item() - ub) <= se and abs(qa.mean().item() - ua) <= se
        cov = (qa * qb).mean().item() - ua * ub
        assert abs(cov - (abs(ua + ub) - 1 - ua * ub)) <= 2 * se and cov <= 2 * se
    # u = 0 on both: the votes cancel exactly, element by element
    zero = torch.zeros(10_001)
    assert torch.all(Q.quantize_bits(zero, key) ^ Q.quantize_bits(zero, key, reflect=True))


def test_out_of_range_u_is_clamped_and_nan_votes_minus_one():
    # the threshold of |u| >= 256 used to overflow int32 (a fair coin); the float32 comparison clamps instead
    edge = torch.tensor([256.0, -256.0, 300.0, 1e30, -1e30, float("inf"), -float("inf"), float("nan"), 1.0, -1.0])
    want = torch.tensor([1, 0, 1, 1, 0, 1, 0, 0, 1, 0], dtype=torch.bool)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for reflect in (False, True):
            for key in (Q.derive_key(0), Q.derive_key(1)):
                assert torch.equal(Q.quantize_bits(edge.to(dtype), key, reflect=reflect), want)


@pytest.mark.parametrize("value", [-1.0, -0.9, -0.3, 0.0, 0.25, 0.77, 1.0])
def test_binary_randomize_is_unbiased(value):
    # N draws of q in {-1, +1} with E[q] = u: the sample mean has sd sqrt(1 - u^2) / sqrt(N) <= 1/sqrt(N).
    # Tolerance: 5 sd (false-alarm rate < 1e-6), plus the codec's bias bound 2^-23.
    n = 400_000
    u = torch.full((n,), value)
    q = Q.binary_randomize(u, generator=123)
    assert set(q.unique().tolist()) <= {-1.0, 1.0}
    sd = math.sqrt(max(1 - value**2, 0.0) / n)
    assert abs(q.mean().item() - value) <= 5 * sd + 2**-23
    if abs(value) == 1.0:
        assert torch.all(q == value)


def test_binary_randomize_per_element_unbiased_over_keys():
    # Each element's own mean over 2000 independent keys matches its u (mixed values in one tensor).
    u = torch.linspace(-1, 1, 101)
    reps = 2000
    acc = torch.zeros_like(u, dtype=torch.float64)
    for s in range(reps):
        acc += Q.binary_randomize(u, generator=s).double()
    err = (acc / reps - u.double()).abs()
    sd = torch.sqrt((1 - u.double() ** 2).clamp_min(0) / reps)
    assert torch.all(err <= 5.5 * sd + 1e-12)


def test_binary_randomize_generator_forms_and_dtype():
    u = torch.rand(1000, dtype=torch.bfloat16) * 2 - 1
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a, b = Q.binary_randomize(u, generator=g1), Q.binary_randomize(u, generator=g2)
    assert a.dtype == torch.bfloat16 and a.shape == u.shape and torch.equal(a, b)
    assert not torch.equal(Q.binary_randomize(u, generator=1), Q.binary_randomize(u, generator=2))
    # out-of-range and NaN inputs are clamped: u >= 1 -> +1, u <= -1 or NaN -> -1
    edge = torch.tensor([5.0, -5.0, float("nan"), float("inf"), -float("inf")])
    assert Q.binary_randomize(edge, generator=0).tolist() == [1.0, -1.0, -1.0, 1.0, -1.0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=0, max_size=300))
def test_pack_unpack_round_trip(bits):
    t = torch.tensor(bits, dtype=torch.bool)
    packed = Q.pack_bits(t)
    assert packed.dtype == torch.uint8 and packed.numel() == (len(bits) + 7) // 8
    assert torch.equal(Q.unpack_bits(packed, len(bits)), t)
    # little-endian layout: bit k of byte i is element 8i + k
    for i, byte in enumerate(packed.tolist()):
        for k in range(8):
            j = 8 * i + k
            assert ((byte >> k) & 1) == (bits[j] if j < len(bits) else 0)


def test_pack_accepts_0_1_integers_and_bad_input_errors():
    assert torch.equal(Q.pack_bits(torch.tensor([1, 0, 1], dtype=torch.int64)), torch.tensor([5], dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        Q.unpack_bits(torch.zeros(2, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match="does not fit"):
        Q.unpack_bits(torch.zeros(2, dtype=torch.uint8), 17)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 70_001])
def test_quantize_pack_equals_pack_of_bits(n):
    u = torch.rand(n) * 2 - 1
    key = Q.derive_key(3)
    bits = Q.quantize_bits(u, key, offset=5)
    assert torch.equal(Q.quantize_pack(u, key, offset=5), Q.pack_bits(bits))
    # counters make slices consistent: bits of u[a:] with offset a are the tail of the full draw
    a = n // 3
    assert torch.equal(Q.quantize_bits(u[a:], key, offset=5 + a), bits[a:])


def _votes(m, nbytes, seed=0):
    return torch.randint(0, 256, (m, nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _reference_mean(rows, numel, dtype):  # (2c - m) / m, one rounding in the work dtype, then to dtype
    m = rows.shape[0]
    count = torch.stack([Q.unpack_bits(r, numel) for r in rows]).sum(0)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return ((2 * count - m).to(work) / m).to(dtype)


@pytest.mark.parametrize("m", [1, 2, 3, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_votes_and_digits_mean(m, dtype):
    rows = _votes(m, 13)
    for numel in (104, 97, 16, 5, 0):
        ref = _reference_mean(rows, numel, dtype)
        assert torch.equal(Q.votes_mean_(torch.empty(numel, dtype=dtype), rows), ref)
        # the same counts as binary digits (plane j = bit j of each count), with one spare plane
        counts = torch.stack([Q.unpack_bits(r, 104) for r in rows]).sum(0)
        planes = torch.stack([Q.pack_bits((counts >> j) & 1) for j in range(m.bit_length() + 1)])
        assert torch.equal(Q.digits_mean_(torch.empty(numel, dtype=dtype), planes, m), ref)
    with pytest.raises(ValueError, match="describe 104"):
        Q.votes_mean_(torch.empty(105), rows)


@pytest.mark.parametrize("m", [1, 3, 4])
def test_requantize_pack_is_quantize_pack_of_the_mean(m):
    rows, key = _votes(m, 40, seed=m), Q.derive_key(4, m)
    mean = _reference_mean(rows, 320, torch.float32)
    assert torch.equal(Q.requantize_pack(rows, key, 77), Q.quantize_pack(mean, key, 77))
    assert torch.equal(Q.requantize_pack(rows, key, 77, reflect=True), Q.quantize_pack(mean, key, 77, reflect=True))
    # per segment, with segment borders inside bytes, and a slice that starts mid-buffer
    keys = Q.BitKeys(3, 5, [2, 0, 1, 3], [13, 1, 250, 56])
    assert torch.equal(keys.requantize_pack(rows, 0, Q.STAGE_SHARD, 1), keys.quantize_pack(mean, 0, Q.STAGE_SHARD, 1))
    assert torch.equal(
        keys.requantize_pack(rows[:, 1:30], 8, Q.STAGE_NODE, 0), keys.quantize_pack(mean[8:240], 8, Q.STAGE_NODE, 0)
    )


def _round_to_float32(x: Fraction) -> float:
    # the float32 nearest to x, ties to even, from exact rational arithmetic (independent of any division)
    c = torch.tensor(float(x), dtype=torch.float32)
    candidates = [torch.nextafter(c, torch.tensor(-math.inf)), c, torch.nextafter(c, torch.tensor(math.inf))]
    return min(candidates, key=lambda v: (abs(Fraction(v.item()) - x), int(v.view(torch.int32)) & 1)).item()


def _compiled_vote_means(rank, world, count, m):
    compiled = torch.compile(Q._vote_mean, dynamic=True, fullgraph=True)
    return {(d, w): compiled(count, m, d, w) for d in (torch.float32, torch.float64) for w in (None, torch.float64)}


def test_vote_mean_is_the_correctly_rounded_quotient_for_every_count():
    # (2c - m) / m for every count c <= m <= 64: the eager division, the compiled one (inductor) and the exact
    # rational rounded once agree bit for bit, in float32 and float64; so does the float64 quotient rounded to
    # float32, which the kernels use off the CPU (Triton's float32 division is approximate)
    pairs = [(c, m) for m in range(1, 65) for c in range(m + 1)]
    count = torch.tensor([c for c, _ in pairs], dtype=torch.int32)
    m = torch.tensor([m for _, m in pairs], dtype=torch.int32)
    want32 = torch.tensor([_round_to_float32(Fraction(2 * c - k, k)) for c, k in pairs], dtype=torch.float32)
    want64 = torch.tensor([float(Fraction(2 * c - k, k)) for c, k in pairs], dtype=torch.float64)
    [compiled] = run_distributed(_compiled_vote_means, 1, count, m, timeout=600)  # the compiler in a forked rank
    for dtype, want in ((torch.float32, want32), (torch.float64, want64)):
        for work in (None, torch.float64):
            assert torch.equal(Q._vote_mean(count, m, dtype, work), want)
            assert torch.equal(compiled[(dtype, work)], want)
    # and through the public kernel, with rows whose columns hold every count of m = 63 votes
    rows = Q.pack_bits(torch.arange(63).view(-1, 1) < torch.arange(64).view(1, -1)).view(63, -1)
    assert torch.equal(Q.votes_mean_(torch.empty(64), rows), (2 * torch.arange(64.0) - 63) / 63)


def test_bitkeys_do_not_depend_on_layout():
    # Two parameters laid out [a, b] or [b, a]: each element gets the same bit either way.
    a, b = torch.rand(37) * 2 - 1, torch.rand(50) * 2 - 1
    k1 = Q.BitKeys(9, 4, [0, 1], [37, 50])
    k2 = Q.BitKeys(9, 4, [1, 0], [50, 37])
    p1 = Q.unpack_bits(k1.quantize_pack(torch.cat([a, b]), 0, Q.STAGE_WORKER, 2), 87)
    p2 = Q.unpack_bits(k2.quantize_pack(torch.cat([b, a]), 0, Q.STAGE_WORKER, 2), 87)
    assert torch.equal(p1[:37], p2[50:]) and torch.equal(p1[37:], p2[:50])
    # a slice starting inside segment 0 and ending inside segment 1 (a shard)
    shard = k1.quantize_pack(torch.cat([a, b])[16:80], 16, Q.STAGE_WORKER, 2)
    assert torch.equal(Q.unpack_bits(shard, 64), p1[16:80])
    # stage and "who" select independent draws
    u = torch.zeros(4096)
    assert not torch.equal(k1.quantize_pack(u[:87], 0, 0, 0), k1.quantize_pack(u[:87], 0, 0, 1))


def test_bitkeys_segment_offsets_give_a_shard_the_full_parameters_bits():
    # FSDP shards: parameter 0's elements 21..36 and parameter 1's 0..29, as two segments with counter offsets,
    # draw exactly the bits those elements get in the full parameters
    a, b = torch.rand(37) * 2 - 1, torch.rand(50) * 2 - 1
    full = Q.BitKeys(9, 4, [0, 1], [37, 50])
    bits = Q.unpack_bits(full.quantize_pack(torch.cat([a, b]), 0, Q.STAGE_WORKER, 1), 87)
    shard = Q.BitKeys(9, 4, [0, 1], [16, 30], [21, 0])
    got = Q.unpack_bits(shard.quantize_pack(torch.cat([a[21:], b[:30]]), 0, Q.STAGE_WORKER, 1), 46)
    assert torch.equal(got, torch.cat([bits[21:37], bits[37:67]]))
    with pytest.raises(ValueError, match="one segment offset"):
        Q.BitKeys(9, 4, [0, 1], [16, 30], [21])


def _codec_compiled_and_eager(rank, world, n):
    """Every codec kernel compiled, then eager, for the same inputs; run in a forked rank so that the compiler stays
    out of the test process (whose later forks run autograd)."""
    torch.manual_seed(n)
    u = torch.rand(n) * 2 - 1
    key = Q.derive_key(1, 2, 3)
    rows = _votes(3, n // 8 + 1)  # m = 3: no exact reciprocal, a division by a constant would show
    counts = torch.stack([Q.unpack_bits(r, 8 * rows.shape[1]) for r in rows]).sum(0)
    planes = torch.stack([Q.pack_bits((counts >> j) & 1) for j in range(2)])
    keys = Q.BitKeys(3, 5, [2, 0, 1], [n // 3, 3, 8 * rows.shape[1] - n // 3 - 3])  # boundaries inside bytes
    edge = torch.tensor([256.0, -300.0, float("inf"), -float("inf"), float("nan"), 1e30, 0.5, -0.5]).repeat(n // 8)

    def run():
        return (
            Q.quantize_pack(u, key, 99),
            Q.quantize_pack(u, key, 99, reflect=True),
            Q.unpack_bits(Q.quantize_pack(edge, key), 8)[:6],  # clamped, NaN -1: [1, 0, 1, 0, 0, 1]
            Q.unpack_bits(Q.quantize_pack(u, key), n),
            Q.votes_mean_(torch.empty(n), rows),
            Q.votes_mean_(torch.empty(n, dtype=torch.bfloat16), rows[:1]),  # the +-1 signs
            Q.digits_mean_(torch.empty(n, dtype=torch.float64), planes, 3),
            Q.requantize_pack(rows, key, 5),  # compiled: a fused kernel; eager: mean, then quantize_pack
            keys.requantize_pack(rows, 0, Q.STAGE_SHARD, 1),
            keys.requantize_pack(rows, 0, Q.STAGE_NODE, 1, reflect=True),
        )

    Q.set_codec_compile(True)
    fast = run()
    Q.set_codec_compile(False)
    return fast, run(), sorted(Q._codec._failed)


@pytest.mark.parametrize("n", [45, (1 << 17) + 13])  # compiled from 16 elements up; not multiples of 8 or 16: tails
def test_compiled_codec_is_bitwise_equal_to_eager(n):
    [(fast, slow, failed)] = run_distributed(_codec_compiled_and_eager, 1, n, timeout=600)
    assert failed == []
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)
    assert fast[2].tolist() == [True, False, True, False, False, True]


def _graphs_after_calls_in_both_grad_modes(rank, world):
    from torch._dynamo.utils import counters

    # a fresh compiler state: the fork inherits the parent's compiled kernels and counters (the full suite compiles
    # codec kernels before this test)
    torch._dynamo.reset()
    Q._codec._compiled.clear()
    counters.clear()
    Q.set_codec_compile(True)
    rows = torch.randint(0, 256, (3, 64), dtype=torch.uint8)

    def call():
        Q.votes_mean_(torch.empty(512), rows)

    call()  # grad enabled (as on gloo's callback thread, and in the DDP hook)
    with torch.no_grad():  # as in step()
        call()
    thread = threading.Thread(target=call)  # a new thread starts with grad enabled
    thread.start()
    thread.join()
    return counters["stats"]["unique_graphs"]


def _compile_then_fork_a_compiling_child(rank, world, budget_s):
    import os
    import tempfile
    import time

    # an empty compile cache: a kernel found on disk is loaded without the compile thread pool, and the child then
    # has no pool to inherit (which is why the hang came and went with the order of the suite's tests)
    with tempfile.TemporaryDirectory(prefix="birder_inductor_") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        torch._dynamo.reset()
        Q._codec._compiled.clear()
        Q.set_codec_compile(True)
        Q.votes_mean_(torch.empty(512), torch.randint(0, 256, (3, 64), dtype=torch.uint8))  # compiles a codec kernel
        assert Q._codec._compiled and not Q._codec._failed
        pid = os.fork()
        if pid == 0:  # the child compiles a kernel of its own (a test's forked rank, a user's worker process)
            try:
                torch.compile(lambda x: x * 3 - 1)(torch.randn(100))
            finally:
                os._exit(0)
        deadline = time.monotonic() + budget_s
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.2)
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return "hung"


def test_a_process_forked_after_the_codec_compiled_can_compile():
    # inductor keeps its compile thread pool across a fork without the threads: a child that compiled waited forever
    # in CppCodeCache.load_async (the test suite's forked ranks, 600 s each); quantize resets the pool in the child
    [code] = run_distributed(_compile_then_fork_a_compiling_child, 1, 300, timeout=600)
    assert code == 0


def test_a_codec_kernel_compiles_once_whatever_the_callers_grad_mode():
    # grad mode is thread-local and guarded by a compiled kernel: a kernel first called in the other mode recompiled,
    # a stall of a second or more at a step set by which thread ran the codec first
    assert run_distributed(_graphs_after_calls_in_both_grad_modes, 1, timeout=600) == [1]
