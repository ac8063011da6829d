"""Write docs/API.md from the code: every public name of birder-hf, its signature with defaults, and one line.

The public names are each public module's ``__all__`` (the package's own ``__all__`` first). A class lists its
constructor and the public methods and properties it defines itself (not those it inherits from torch or a
framework). The line is the first sentence of the docstring. ``tests/test_docs.py`` fails when docs/API.md is not
what this script writes, so after changing a public name, signature or docstring's first sentence run:

    python docs/gen_api.py            # rewrites docs/API.md
    python docs/gen_api.py --check    # exit 1 if docs/API.md is out of date
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "API.md"

# the package first, then its modules in the order a reader meets them; private modules (a leading _) are left out
MODULES = [
    "birder_hf",
    "birder_hf.optim",
    "birder_hf.hook",
    "birder_hf.topology",
    "birder_hf.collectives",
    "birder_hf.settings",
    "birder_hf.lifecycle",
    "birder_hf.quantize",
    "birder_hf.checkpoint",
    "birder_hf.elastic",
    "birder_hf.together",
    "birder_hf.fsdp",
    "birder_hf.onebit_adam",
    "birder_hf.communicators",
    "birder_hf.base",
    "birder_hf.reference",
    "birder_hf.model_card",
    "birder_hf.preflight",
    "birder_hf.integrations.accelerate",
    "birder_hf.integrations.transformers",
    "birder_hf.integrations.hsdp_trainer",
    "birder_hf.integrations.timm",
    "birder_hf.integrations.lightning",
]


def _first_sentence(obj) -> str:
    # the object's own docstring only: an override without one would otherwise show its framework's (which changes
    # with the framework's version, not with this code)
    own = obj.__doc__ if isinstance(obj, (type, property)) or callable(obj) or inspect.ismodule(obj) else None
    doc = inspect.cleandoc(own) if isinstance(own, str) else ""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    # the first sentence ends at . ! ? before a capital or the end ("e.g." and "i.e." do not end one)
    match = re.match(r"(.+?(?<!e\.g)(?<!i\.e)[.!?])(?=\s+[A-Z`(:]|$)", para)
    return match.group(1) if match else para


def _default(value) -> str:
    text = repr(value)
    if " at 0x" in text:  # functions, objects: their name, not an address that changes every run
        text = getattr(value, "__qualname__", type(value).__qualname__)
    return text


def _signature(obj, drop_self: bool = False) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = list(sig.parameters.values())
    if drop_self and params and params[0].name in ("self", "cls"):
        params = params[1:]
    parts, star_done = [], False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
            parts.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            parts.append(p.name if p.default is p.empty else f"{p.name}={_default(p.default)}")
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            parts.append("/")
    return "(" + ", ".join(parts) + ")"


def _members(cls) -> list[tuple[str, str, str]]:
    """(name, signature or "property", line) of the public methods and properties ``cls`` defines itself."""
    out = []
    for name, raw in cls.__dict__.items():
        if name.startswith("_"):
            continue
        if isinstance(raw, property):
            out.append((name, "property", _first_sentence(raw)))
        elif isinstance(raw, (classmethod, staticmethod)):
            func = raw.__func__
            out.append((name, _signature(func, drop_self=isinstance(raw, classmethod)), _first_sentence(func)))
        elif inspect.isfunction(raw):
            if inspect.unwrap(raw).__qualname__.split(".")[0] != cls.__name__:
                continue  # torch.optim.Optimizer patches a wrapped `step` into the class of its first instance
            out.append((name, _signature(raw, drop_self=True), _first_sentence(raw)))
    return out


def _entry(module: str, name: str, obj) -> list[str]:
    if inspect.isclass(obj):
        lines = [f"- **`{name}{_signature(obj)}`** (class): {_first_sentence(obj)}"]
        for member, sig, line in _members(obj):
            shown = f"`{member}` (property)" if sig == "property" else f"`{member}{sig}`"
            lines.append(f"  - {shown}: {line}" if line else f"  - {shown}")
        return lines
    if callable(obj):
        return [f"- **`{name}{_signature(obj)}`**: {_first_sentence(obj)}"]
    text = repr(obj)
    shown = text if len(text) <= 80 and "\n" not in text else f"<{type(obj).__name__}>"
    return [f"- **`{name}`** = `{shown}`"]


def generate() -> str:
    lines = [
        "# API reference",
        "",
        "<!-- generated by `python docs/gen_api.py` from the code; do not edit by hand "
        "(tests/test_docs.py fails when this file drifts) -->",
        "",
        "Every public name of birder-hf: each public module's `__all__`, with its signature, defaults and the first",
        "sentence of its docstring (the docstring itself has the arguments, in the Hugging Face form). Classes list",
        "the public methods and properties they define themselves. How to choose the settings:",
        "[GUIDE.md](GUIDE.md); what each integration does: [SETUPS.md](SETUPS.md).",
        "",
    ]
    seen = {}
    for module in MODULES:
        mod = importlib.import_module(module)
        names = [n for n in mod.__all__ if not n.startswith("_")]
        lines += [f"## `{module}`", "", _first_sentence(mod), ""]
        for name in names:
            obj = getattr(mod, name)
            home = seen.get(id(obj)) if inspect.isclass(obj) or inspect.isfunction(obj) else None
            if home is not None:  # re-exported: said once, where it was first listed
                lines.append(f"- **`{name}`**: the same as `{home}.{name}`")
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                seen[id(obj)] = module
            lines += _entry(module, name, obj)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/API.md is not what the code gives")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    text = generate()
    if args.check:
        same = OUT.is_file() and OUT.read_text(encoding="utf-8") == text
        print("docs/API.md is up to date" if same else "docs/API.md is out of date: run python docs/gen_api.py")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
