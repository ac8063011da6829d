"""What a stored result records about the run that made it: the commit, the command line, uncommitted edits.

Every benchmark that writes a result JSON under ``docs/results`` merges :func:`provenance` into the dict it dumps, so
a stored number says which code and which settings produced it (``docs/gen_results.py`` cites the commit next to the
number). Scripts in ``benchmarks/`` and ``benchmarks/system/`` import it the way they import ``plots``: with
``benchmarks/`` on ``sys.path``.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the code a benchmark run executes: the library, the recipes it launches, the benchmarks themselves
CODE = ("src", "recipes", "benchmarks")


def _git(*args: str) -> str | None:
    """``git args`` in the repository: its output, or None where git or the repository is unavailable."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def provenance(script: str | Path, argv=None) -> dict:
    """``{"report_commit", "command", "dirty"}`` for a result written by ``script`` (its ``__file__``) run with
    ``argv`` (default: ``sys.argv[1:]``).

    ``report_commit``: ``git rev-parse HEAD``, None without git. ``command``: the command line, repeatable from the
    repository root. ``dirty``: whether ``src/``, ``recipes/`` or ``benchmarks/`` had uncommitted changes (the run's
    code was then not exactly ``report_commit``'s), None without git.
    """
    head = (_git("rev-parse", "HEAD") or "").strip() or None
    status = _git("status", "--porcelain", "--", *CODE)
    path = Path(script).resolve()
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    return {
        "report_commit": head,
        "command": shlex.join(["python", rel, *args]),
        "dirty": None if status is None else bool(status.strip()),
    }
