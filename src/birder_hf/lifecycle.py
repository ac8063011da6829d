"""The lifecycle of the 1-bit all-reduce's callbacks and process groups: a leaf module (torch only).

A Python callback given to ``Future.then`` runs on a thread of the backend (gloo's workers, NCCL's callback thread),
and torch releases it there afterwards, taking the GIL to do so. The thread that waits for the Future wakes up as
soon as the callback has produced its value, before that release: a process that then exits can start finalizing
the interpreter first, and a backend thread that asks for the GIL during finalization is ended through a noexcept
destructor ("terminate called without an active exception": SIGABRT after a finished run). So every callback is
counted until torch has released it (:func:`then`), and the process waits for the count to reach 0 before it
finalizes (atexit, which then closes the tracked owners of process groups and destroys the default group) and
before a topology's groups are destroyed (``Topology.close``).
"""

from __future__ import annotations

import atexit
import threading
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["then", "wait_for_callbacks", "release_process_groups", "track_groups", "untrack_groups", "close_tracked"]

# The owners of process groups (topologies) not closed yet. At exit they are closed after the callbacks are released:
# a group whose last reference would otherwise go at the interpreter's finalization has its threads joined there,
# which aborted finished runs under load.
_OPEN: weakref.WeakSet = weakref.WeakSet()


def track_groups(owner) -> None:
    """Close ``owner`` (anything with ``close()``) at exit, after the callbacks are released, unless it is closed
    first (:func:`untrack_groups`)."""
    _OPEN.add(owner)
    _LIVE.register_exit_handler()


def untrack_groups(owner) -> None:
    """Forget ``owner`` (it closed itself)."""
    _OPEN.discard(owner)


def close_tracked() -> None:
    """Close every tracked owner of process groups that is still open."""
    for owner in list(_OPEN):
        owner.close()


class _Callback:
    __slots__ = ("fn", "__weakref__")

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, fut):
        return self.fn(fut)


class _LiveCallbacks:
    def __init__(self):
        self.cond = threading.Condition()
        self.refs: set[weakref.ref] = set()
        self.exit_wait_registered = False

    def add(self, cb: _Callback) -> None:
        with self.cond:
            self.refs.add(weakref.ref(cb, self._released))
        self.register_exit_handler()

    def register_exit_handler(self) -> None:
        # once, late: after torch's own handlers, so it runs before them (atexit runs the last registered first)
        with self.cond:
            if not self.exit_wait_registered:
                atexit.register(_release_at_exit)
                self.exit_wait_registered = True

    def _released(self, ref: weakref.ref) -> None:  # on the thread that released the callback, holding the GIL
        with self.cond:
            self.refs.discard(ref)
            self.cond.notify_all()

    def wait(self, timeout: float | None) -> bool:
        with self.cond:  # waiting releases the GIL, so the backend's threads can finish
            return self.cond.wait_for(lambda: not self.refs, timeout)


_LIVE = _LiveCallbacks()
_EXIT_TIMEOUT_S = 10.0  # a finished run needs milliseconds; a peer that died must not hold up the exit for long


def then(fut: torch.futures.Future, fn: Callable) -> torch.futures.Future:
    """``fut.then(fn)``, with ``fn`` counted until torch has released it on the backend's thread (module docstring)."""
    cb = _Callback(fn)
    _LIVE.add(cb)
    return fut.then(cb)


def release_process_groups(*, barrier: bool = True, timeout: float | None = _EXIT_TIMEOUT_S) -> None:
    """End a training script: wait for the 1-bit all-reduce's callbacks, meet the other ranks (``barrier``), then
    destroy every process group. A group left to the interpreter's teardown is destroyed while gloo's threads may still
    ask for the GIL: SIGABRT ("terminate called without an active exception") after a finished run, seen with plain
    DDP under load too. The recipes call this after training; an atexit handler calls it without the barrier."""
    if not wait_for_callbacks(timeout):
        return
    initialized = dist.is_available() and dist.is_initialized()
    if initialized and barrier:
        dist.barrier()
    # the topologies' own groups too, even after the user's destroy_process_group(): a hook state still holds them,
    # and a group whose last reference goes at the interpreter's finalization joins its threads there
    close_tracked()
    if initialized:
        dist.destroy_process_group()


def _release_at_exit() -> None:
    try:
        release_process_groups(barrier=False)  # at exit a peer may be gone: no barrier
    except Exception:  # noqa: BLE001  (exiting anyway: never turn a finished run into a failed one)
        pass


def wait_for_callbacks(timeout: float | None = None) -> bool:
    """Wait until every callback that :func:`then` gave to a Future has run and been released (``timeout`` in
    seconds; ``None``: no limit). Returns ``False`` on timeout, with a warning: a callback still waits for a peer."""
    if _LIVE.wait(timeout):
        return True
    message = f"birder_hf: {len(_LIVE.refs)} callback(s) of the 1-bit all-reduce still wait for a collective after "
    message += f"{timeout} s (a peer rank failed or has not joined); the process may abort when it exits."
    warnings.warn(message, RuntimeWarning, stacklevel=2)
    return False
