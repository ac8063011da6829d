"""birder-hf: Birder, a 1-bit adaptive optimizer with Hierarchical-1-bit-All-Reduce, for the HF / PyTorch stack.

Paper: `Birder: Communication-Efficient 1-bit Adaptive Optimizer for Practical Distributed DNN
Training` (Peng et al., NeurIPS 2023) - https://openreview.net/forum?id=Mlo2kM11ZB
"""

__version__ = "0.1.0"

from .collectives import CommStats, onebit_all_reduce
from .hook import BirderHookState, attach_ddp_hook, birder_hook
from .onebit_adam import OneBitAdam, OneBitAdamHookState, onebit_adam_hook
from .optim import Birder, birder
from .topology import Topology

__all__ = [
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
    "__version__",
]
