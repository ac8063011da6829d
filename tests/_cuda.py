"""Marks and helpers of the CUDA suite (``tests/test_gpu_*.py``): ``python -m pytest -m "gpu or multi_gpu"``.

Every CUDA test carries the ``gpu`` (one device) or ``multi_gpu`` (two or more, NCCL) mark, which ``pyproject.toml``
deselects by default, and is skipped with a reason where CUDA is missing, so that ``pytest -m gpu`` on a CPU machine
reports skips, not errors. Nothing here initializes CUDA at import: ``torch.cuda.is_available()`` and
``device_count()`` ask NVML when ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (``tests/conftest.py`` sets it), so forked
CPU ranks of the other tests stay usable. Multi-rank CUDA tests start their ranks with ``spawn``
(``_dist.run_distributed(..., start_method="spawn")``).

Host synchronisation is counted two ways while a function runs: the profiler's CUDA runtime calls
(``cudaStreamSynchronize`` and friends, on any thread: DDP runs the hook on autograd's device thread) and
``torch.cuda.set_sync_debug_mode("warn")``'s warnings.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch

__all__ = [
    "HAS_CUDA",
    "N_CUDA",
    "GLOO_CUDA",
    "gpu",
    "multi_gpu",
    "host_syncs",
    "delay_stream",
    "eager_codec",
    "cpu_threads",
]

HAS_CUDA = torch.cuda.is_available()
N_CUDA = torch.cuda.device_count() if HAS_CUDA else 0
# gloo moves CUDA tensors through pinned host memory (all_gather, all_to_all, all_reduce, broadcast); NCCL refuses
# two ranks on one device, so this is how one GPU runs several ranks' CUDA code paths.
GLOO_CUDA = "cpu:gloo,cuda:gloo"

_NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False"
_NO_MULTI = f"needs 2+ CUDA devices, found {N_CUDA}"


def gpu(obj):
    """Mark a test ``gpu`` and skip it without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason=_NO_CUDA)(obj))


def multi_gpu(obj):
    """Mark a test ``multi_gpu`` and skip it with fewer than two CUDA devices."""
    return pytest.mark.multi_gpu(pytest.mark.skipif(N_CUDA < 2, reason=_NO_MULTI)(obj))


# CUDA runtime / driver calls that block the host until the device has caught up
SYNC_CALLS = frozenset(
    {
        "cudaDeviceSynchronize",
        "cudaStreamSynchronize",
        "cudaEventSynchronize",
        "cudaMemcpy",
        "cuCtxSynchronize",
        "cuStreamSynchronize",
        "cuEventSynchronize",
    }
)
_WINDOW = "birder_test::window"


def host_syncs(fn) -> dict:
    """Run ``fn()`` and report the host synchronisations made while it ran.

    Returns ``{"syncs": [runtime call names], "runtime_calls": n, "sync_warnings": [messages]}``; ``runtime_calls``
    counts every CUDA runtime call the profiler saw in the window (0 means it saw nothing, and ``syncs`` proves
    nothing).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function(_WINDOW):
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    fn()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
    events = list(prof.events())
    window = next(e for e in events if e.name == _WINDOW)
    lo, hi = window.time_range.start, window.time_range.end
    inside = [e for e in events if e is not window and lo <= e.time_range.start <= hi]
    return {
        "syncs": sorted(e.name for e in inside if e.name in SYNC_CALLS),
        "runtime_calls": sum(e.name.startswith("cuda") for e in inside),
        "sync_warnings": sorted({str(w.message) for w in caught if "synchroniz" in str(w.message)}),
    }


@contextlib.contextmanager
def eager_codec():
    """The codec's eager kernels inside: for CPU references (no C++ compile on the device; the same bits)."""
    from birder_hf.quantize import set_codec_compile

    before = set_codec_compile(False)
    try:
        yield
    finally:
        set_codec_compile(before)


@contextlib.contextmanager
def cpu_threads():
    """Every core for a large CPU reference (conftest pins one thread for forked CI ranks)."""
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def delay_stream(ms: float = 30.0) -> None:
    """Keep the current stream busy for about ``ms`` milliseconds (the host runs on): work queued after this
    runs late, so a consumer on another stream that does not wait for it reads stale memory."""
    torch.cuda._sleep(int(ms * 1e-3 * 2.0e9))  # cycles; ~2 GHz SM clock
