"""Shared pytest setup. Multi-rank helpers live in ``tests/_dist.py`` (``run_distributed``)."""

import os

# Forked ranks inherit this; one thread per rank keeps 2-core CI from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# torch.cuda.is_available()/device_count() ask NVML instead of initializing the CUDA driver in the pytest process
# (tests/_cuda.py): forked CPU ranks of the other tests must not inherit an initialized driver.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
