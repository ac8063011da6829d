"""Shared pytest setup. Multi-rank helpers live in ``tests/_dist.py`` (``run_distributed``)."""

import os

# Forked ranks inherit this; one thread per rank keeps 2-core CI from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
