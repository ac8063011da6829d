"""The Python snippets of the README and of docs/SETUPS.md run as written (each names its launch command on its first
line)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATTERN = re.compile(r"```python\n# run: (.+?)\n(.*?)```", flags=re.S)


def _snippets(name):
    return PATTERN.findall(open(os.path.join(ROOT, name), encoding="utf-8").read())


SNIPPETS = _snippets("README.md") + _snippets("docs/SETUPS.md")


def test_readme_has_the_snippets():
    assert len(_snippets("README.md")) == 5  # one process, DDP, Trainer, accelerate, local steps
    assert len(SNIPPETS) == 8  # and SETUPS' timm, Lightning and FSDP


IDS = ["one-process", "ddp", "trainer", "accelerate", "local-steps", "timm", "lightning", "fsdp"]


@pytest.mark.parametrize("command, code", SNIPPETS, ids=IDS[: len(SNIPPETS)])
def test_snippet_runs(command, code, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(code)
    argv = command.format(file=script).split()
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT + "/src"}
    res = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    if "torch.distributed.run" in argv or "BirderDDPStrategy" in code:  # the multi-process snippets report savings
        assert "fewer bytes than fp32 all-reduce" in res.stdout
