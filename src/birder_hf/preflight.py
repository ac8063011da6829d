"""``birder-hf preflight``: check a multi-node launch in seconds, instead of hanging for the process-group timeout.

``python -m birder_hf.preflight`` runs it; the command lives in :mod:`birder_hf.cli` (see ``cli/preflight.py``).
"""

import sys

from .cli.preflight import EXIT_CODES, PreflightError, cli, main

__all__ = ["main", "cli", "PreflightError", "EXIT_CODES"]

if __name__ == "__main__":
    sys.exit(main())
