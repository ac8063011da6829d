"""Run a function on several real ranks (forked processes, gloo over loopback) and collect the results.

Forking (with ``torch._dynamo`` imported once in the parent) starts a 2-rank group in ~0.3 s; ``spawn``
took ~20 s here. Each rank's traceback comes back to the parent, and stragglers are killed.

CUDA cannot be used in a forked child once the parent has initialized it, so the CUDA tests
(``tests/test_gpu_*.py``) start their ranks with ``start_method="spawn"`` and an NCCL or
``"cpu:gloo,cuda:gloo"`` backend; ``fn`` must then be a module-level function.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import sys
import tempfile
import time
import traceback

import torch
import torch._dynamo  # noqa: F401  (import once before forking: the children then start fast)
import torch.distributed as dist

__all__ = ["run_distributed"]

_GRACE_S = 5.0  # after one rank fails, how long the others get to finish before they are killed


def _forget_parent_singletons():
    # accelerate's PartialState/AcceleratorState are Borg singletons: a fork inherits the parent's
    # (single-process) state, and the rank would believe it is alone. Start each rank from scratch.
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


def _child(q, init_file, rank, world_size, fn, args, env, local_world_size, backend="gloo"):
    try:
        os.environ.update({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
        if local_world_size is not None:
            os.environ.update(
                {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world_size),
                    "LOCAL_RANK": str(rank % local_world_size),
                    "LOCAL_WORLD_SIZE": str(local_world_size),
                    "GROUP_RANK": str(rank // local_world_size),
                }
            )
        extra = env(rank) if callable(env) else env
        os.environ.update({k: str(v) for k, v in (extra or {}).items()})
        torch.set_num_threads(1)
        _forget_parent_singletons()
        if "nccl" in backend:  # one GPU per rank, as torchrun's LOCAL_RANK would pick
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
            # no rank tears its groups down while a peer may still be connecting to them (gloo's connectFullMesh
            # can return on one rank first: the peer then sees "Connection closed by peer")
            dist.barrier()
        finally:
            dist.destroy_process_group()
        # plain pickle: torch's queue reducers would share tensors through fds that die with this process
        q.put((rank, True, pickle.dumps(result)))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn,
    world_size: int,
    *args,
    timeout: float = 120,
    env=None,
    local_world_size: int | None = None,
    backend: str = "gloo",
    start_method: str = "fork",
):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks of a gloo group; return the results.

    Args:
        fn: a module-level or nested function; its return value must be picklable.
        timeout: seconds for the whole run; ranks still alive then are killed and the call raises.
        env: extra environment variables, a dict for every rank or a callable ``rank -> dict``.
        local_world_size: if given, set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK as
            torchrun does for node-major ranks with that many ranks per node.
        backend: the process group's backend (``"nccl"``, ``"cpu:gloo,cuda:gloo"``, ...).
        start_method: ``"fork"`` (fast) or ``"spawn"`` (needed for CUDA once the parent has used it).

    Raises:
        RuntimeError: with the failing rank's traceback, or naming the ranks that timed out.
    """
    ctx = mp.get_context(start_method)
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="birder_dist_") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_child,
                args=(q, init_file, rank, world_size, fn, args, env, local_world_size, backend),
                daemon=False,  # a rank may start worker processes (torch.compile); we kill stragglers
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size and time.monotonic() < deadline:
                failed = any(not ok for ok, _ in results.values())
                if failed:
                    deadline = min(deadline, time.monotonic() + _GRACE_S)
                try:
                    rank, ok, value = q.get(timeout=0.05)
                    results[rank] = (ok, pickle.loads(value) if ok else value)
                except queue_mod.Empty:
                    # a rank that died without reporting (segfault, os._exit) will never answer
                    dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                    if dead and q.empty():
                        time.sleep(0.2)  # the queue's feeder may still be flushing
                        if q.empty():
                            for r in dead:
                                results[r] = (False, f"rank {r} exited with code {procs[r].exitcode} and no report")
        finally:
            for p in procs:
                p.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if len(results) == world_size else 0)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            q.close()
            q.join_thread()
    errors = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(results.items()) if not ok]
    missing = [r for r in range(world_size) if r not in results]
    if errors or missing:
        msg = "\n".join(errors)
        if missing:
            why = f"after a rank failed (+{_GRACE_S} s)" if errors else f"within {timeout} s"
            msg += f"\nranks {missing} did not finish {why} and were killed"
        raise RuntimeError(f"run_distributed({getattr(fn, '__name__', fn)}, {world_size}) failed:\n{msg}")
    codes = [p.exitcode for p in procs]
    if any(c != 0 for c in codes):
        raise RuntimeError(f"ranks reported results but exit codes were {codes}")
    return [results[r][1] for r in range(world_size)]
