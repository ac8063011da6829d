"""Shared pytest setup. Multi-rank helpers live in ``tests/_dist.py`` (``run_distributed``)."""

import os

# Forked ranks inherit this; one thread per rank keeps 2-core CI from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# torch.cuda.is_available()/device_count() ask NVML instead of initializing the CUDA driver in the pytest process
# (tests/_cuda.py): forked CPU ranks of the other tests must not inherit an initialized driver.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# Without a GPU (CI), the 1-bit codec's eager kernels in every test process and rank: compiling them costs seconds
# per process, and a test's ranks live for a few steps. The compiled kernels are checked against these, bit for bit,
# where a test switches them on (tests/test_quantize.py::test_compiled_codec_is_bitwise_equal_to_eager). With a GPU
# the suite keeps the compiled (Triton) kernels that its CUDA tests check.
import torch  # noqa: E402  (after the NVML setting above)

if not torch.cuda.is_available():
    os.environ.setdefault("BIRDER_HF_CODEC_COMPILE", "0")
