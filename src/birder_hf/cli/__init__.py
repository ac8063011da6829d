"""The ``birder-hf`` console script: ``birder-hf preflight`` (``preflight.py``), its ranks (``ranks.py``) and what
both share (``common.py``)."""
