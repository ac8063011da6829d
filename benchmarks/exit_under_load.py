"""Does the README's DDP snippet exit cleanly under CPU load, with and without ``state.close()``?

    python benchmarks/exit_under_load.py --runs 40 --out docs/results/exit_under_load.json

Takes the README's DDP snippet as written (``close``) and as users wrote it before ``state.close()`` was added
(``no_close``: the same lines without it; ``dist.destroy_process_group()`` stays), and runs each ``--runs`` times, in
turn, through ``torchrun --standalone --nproc_per_node 2`` while two busy loops hold the cores. A run fails when
torchrun exits non-zero or any output says ``terminate called`` (the SIGABRT seen at shutdown). ``--src`` runs a copy
of the package (say, a snapshot of a commit) instead of this checkout's ``src/``. The JSON is rewritten after every
run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def snippets() -> dict[str, tuple[str, str]]:
    """``{"close": (command, code), "no_close": (command, code)}`` from the README's first (DDP) snippet."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    command, code = re.findall(r"```python\n# run: (.+?)\n(.*?)```", text, flags=re.S)[0]
    if "state.close()" not in code or "dist.destroy_process_group()" not in code:
        raise SystemExit("the README's DDP snippet no longer calls state.close() and destroy_process_group()")
    no_close = "".join(line for line in code.splitlines(keepends=True) if not line.startswith("state.close()"))
    return {"close": (command, code), "no_close": (command, no_close)}


def _spin() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        pass


def run(runs: int, src: str, variants: list[str], progress=None) -> dict:
    """Run the variants in turn (one run of each, ``runs`` times); ``progress(result)`` after every run."""
    busy = [mp.get_context("fork").Process(target=_spin, daemon=True) for _ in range(2)]
    for p in busy:
        p.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": src}
    out = {name: {"runs": 0, "failures": 0, "walls_s": [], "failed_runs": []} for name in variants}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            argvs = {}
            for name in variants:
                command, code = snippets()[name]
                script = os.path.join(tmp, f"{name}.py")
                with open(script, "w") as f:
                    f.write(code)
                argvs[name] = [sys.executable, "-m", "torch.distributed.run", *command.format(file=script).split()[1:]]
            for i in range(runs):
                for name in variants:
                    t0 = time.monotonic()
                    res = subprocess.run(argvs[name], cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
                    row = out[name]
                    row["runs"] += 1
                    row["walls_s"].append(round(time.monotonic() - t0, 1))
                    text = res.stdout + res.stderr
                    if res.returncode != 0 or "terminate called" in text:
                        row["failures"] += 1
                        row["failed_runs"].append({"run": i + 1, "returncode": res.returncode, "tail": text[-1500:]})
                    print(f"{name} run {i + 1}: rc {res.returncode} {row['walls_s'][-1]} s", flush=True)
                    if progress is not None:
                        progress(out)
    finally:
        for p in busy:
            p.kill()
            p.join()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--variants", nargs="+", default=["no_close", "close"], choices=["no_close", "close"])
    parser.add_argument("--src", default=os.path.join(ROOT, "src"), help="the birder_hf package to run (its parent)")
    parser.add_argument("--ref", default="", help="the commit --src was taken from (recorded)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped early: the busy loops end with it (finally)
    import torch

    result = {
        **provenance(__file__, argv),
        "what": "README DDP snippet, torchrun --standalone --nproc_per_node 2 (gloo), two busy loops on the cores",
        "ref": args.ref,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0],
    }

    def write(out: dict) -> None:  # after every run: a long measurement stopped early keeps what it counted
        if args.out:
            with open(args.out, "w") as f:
                f.write(json.dumps({**result, **out}, indent=1) + "\n")

    result.update(run(args.runs, args.src, args.variants, progress=write))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
