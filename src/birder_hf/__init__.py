"""birder-hf: Birder, a 1-bit adaptive optimizer with Hierarchical-1-bit-All-Reduce, for the HF / PyTorch stack.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB

The public names load on first use (PEP 562), so that ``birder-hf preflight`` can check a launch's network before
it pays for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "Birder": "optim",
    "birder": "optim",
    "Topology": "topology",
    "onebit_all_reduce": "collectives",
    "CommStats": "collectives",
    "BirderHookState": "hook",
    "birder_hook": "hook",
    "attach_ddp_hook": "hook",
    "OneBitAdam": "onebit_adam",
    "OneBitAdamHookState": "onebit_adam",
    "onebit_adam_hook": "onebit_adam",
    "LocalSteps": "local_steps",
}

__all__ = [  # the names of _EXPORTS (a test checks they agree)
    "Birder",
    "birder",
    "Topology",
    "onebit_all_reduce",
    "CommStats",
    "BirderHookState",
    "birder_hook",
    "attach_ddp_hook",
    "OneBitAdam",
    "OneBitAdamHookState",
    "onebit_adam_hook",
    "LocalSteps",
    "__version__",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports on first use
    from .collectives import CommStats, onebit_all_reduce
    from .hook import BirderHookState, attach_ddp_hook, birder_hook
    from .local_steps import LocalSteps
    from .onebit_adam import OneBitAdam, OneBitAdamHookState, onebit_adam_hook
    from .optim import Birder, birder
    from .topology import Topology


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'birder_hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *_EXPORTS})
