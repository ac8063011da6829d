"""Thin integrations with accelerate, transformers and timm; each imports its framework lazily."""

from contextlib import contextmanager


@contextmanager
def needs_extra(module: str, framework: str, extra: str):
    """Turn an ``ImportError`` inside the block into what to install: ``pip install 'birder-hf[<extra>]'``."""
    try:
        yield
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError(f"{module} needs {framework}: pip install 'birder-hf[{extra}]'") from exc
