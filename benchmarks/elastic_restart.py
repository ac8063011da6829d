"""What an elastic restart costs with the BERT recipe: time from a SIGKILL to training again, steps lost, and the
checkpoint write time per rank.

    python benchmarks/elastic_restart.py --model_config tiny --out docs/results/elastic_restart_tiny.json
    python benchmarks/elastic_restart.py --model_config base --per_device_train_batch_size 2 \\
        --out docs/results/elastic_restart_base.json

Runs ``recipes/bert_base.py`` under ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --max_restarts 1``
on ``--nproc`` CPU processes with ``--resume_from_checkpoint auto``, a checkpoint every ``--save_steps``; rank 1
SIGKILLs itself as it starts step ``--kill_step`` (``tests/_elastic_script.py``, which also stamps the events). The
agent restarts every worker; they resume from the newest complete checkpoint and finish ``--max_steps``.

Reported (wall-clock, from the workers' own timestamps):
- ``kill_to_restart_s``: the kill until the restarted workers' processes start (the agent notices the dead worker,
  stops the others, re-forms the rendezvous and launches them again);
- ``restart_to_training_s``: from there until every rank begins its first step, split at the log line that names
  the checkpoint chosen: ``restart_to_checkpoint_chosen_s`` (imports, data, model, Trainer) and
  ``checkpoint_chosen_to_training_s`` (reading the checkpoint: the framework's files and this rank's Birder state,
  DDP and the hook);
- ``kill_to_training_s``: the sum; ``steps_lost``: the kill step minus the step resumed at;
- ``checkpoint_write_s``: per rank and checkpoint, ``own_files_s`` writing this rank's files (weights, optimizer.pt
  and trainer_state.json on rank 0; every rank's RNG and Birder state) and ``until_complete_s`` in the Trainer's
  ``_save_checkpoint`` in all (the completion marker's all-gather waits for the slowest rank, then rank 0 writes it);
- ``checkpoint_bytes``: the files of one checkpoint, by kind.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(args) -> dict:
    work = tempfile.mkdtemp(prefix="elastic_restart_")
    out, events = os.path.join(work, "out"), os.path.join(work, "events.jsonl")
    recipe_args = [
        "--model_config", args.model_config,
        "--embedded_num_train", "800",
        "--embedded_num_eval", "100",
        "--per_device_train_batch_size", str(args.per_device_train_batch_size),
        "--max_steps", str(args.max_steps),
        "--save_steps", str(args.save_steps),
        "--logging_steps", "1",
        "--output_dir", out,
        "--resume_from_checkpoint", "auto",
    ]  # fmt: skip
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
        "--max_restarts", "1", "tests/_elastic_script.py", "recipes/bert_base.py", *recipe_args,
    ]  # fmt: skip
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.path.join(ROOT, "src"),
        "BIRDER_TEST_KILL": json.dumps([{"at": "step", "step": args.kill_step, "ranks": [1]}]),
        "BIRDER_TEST_EVENTS": events,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # a new store per attempt (docs/SETUPS.md)
    }
    began = time.time()
    res = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.time() - began
    log = res.stdout + res.stderr
    if res.returncode != 0:
        raise SystemExit(f"the elastic run failed ({res.returncode}):\n{log[-6000:]}")
    seen = [json.loads(line) for line in open(events)]
    (kill,) = [e for e in seen if e["event"] == "kill"]
    restarted = [e for e in seen if e["restart"] == 1]
    started = min(e["t"] for e in restarted if e["event"] == "start")
    firsts = [e for e in restarted if e["event"] == "first_step"]
    training = max(e["t"] for e in firsts)
    (resumed_at,) = {e["step"] for e in firsts}
    # the restarted rank 0's "Resuming from ..." line: its time (asctime, local time) splits the restart
    resumed = [line for line in log.splitlines() if "Resuming from" in line][-1]
    chosen = datetime.datetime.strptime(resumed[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    writes: dict = {}
    for e in seen:
        if e["event"] == "checkpoint":
            where = f"checkpoint-{e['step']} (attempt {e['restart']})"
            writes.setdefault(f"rank {e['rank']}", {})[where] = {
                "own_files_s": round(e["own_seconds"], 3),
                "until_complete_s": round(e["seconds"], 3),
            }
    ckpt = os.path.join(out, f"checkpoint-{args.save_steps}")
    sizes: dict = {}
    for root, _, names in os.walk(ckpt):
        for name in names:
            kind = "birder per-rank state" if os.path.basename(root) == "birder" else name
            kind = "rng state (per rank)" if name.startswith("rng_state") else kind
            sizes[kind] = sizes.get(kind, 0) + os.path.getsize(os.path.join(root, name))
    shutil.rmtree(work)
    return {
        "kill_step": args.kill_step,
        "resumed_at_step": resumed_at,
        "steps_lost": args.kill_step - resumed_at,
        "kill_to_restart_s": round(started - kill["t"], 2),
        "restart_to_training_s": round(training - started, 2),
        "restart_to_checkpoint_chosen_s": round(chosen - started, 2),
        "checkpoint_chosen_to_training_s": round(training - chosen, 2),
        "kill_to_training_s": round(training - kill["t"], 2),
        "checkpoint_write_s": writes,
        "checkpoint_bytes": dict(sorted(sizes.items())),
        "total_wall_s": round(wall, 1),
        "resumed_log_line": resumed.split(": ", 1)[-1].replace(work + os.sep, ""),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_config", default="tiny", choices=("tiny", "base"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--max_steps", type=int, default=12)
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--kill_step", type=int, default=6)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not args.save_steps <= args.kill_step < min(2 * args.save_steps, args.max_steps):
        parser.error("--kill_step must fall after the first checkpoint and before the second")
    result = {
        **provenance(__file__, argv),
        "recipe": "recipes/bert_base.py",
        "model_config": args.model_config,
        "nproc": args.nproc,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "max_steps": args.max_steps,
        "save_steps": args.save_steps,
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, shared with other jobs",
        "load_average_before": round(os.getloadavg()[0], 1),
        **run(args),
        "load_average_after": round(os.getloadavg()[0], 1),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
