"""Run a recipe as one worker of torchrun's elastic agent, with planned SIGKILLs (tests/test_elastic.py).

    python -m torch.distributed.run --max_restarts 2 ... tests/_elastic_script.py recipes/bert_base.py <recipe args>

``BIRDER_TEST_KILL`` (JSON list) plans the kills; each entry kills the matching processes with SIGKILL, nothing
cleaned up, as a lost machine would, once (the events file remembers it):

    {"at": "step", "step": 6, "ranks": [1]}                  # rank 1, as it starts step 7
    {"at": "save", "step": 8, "ranks": [0], "from": 4}       # rank 0 of an attempt that resumed at step 4, while
                                                             # writing checkpoint-8 (its Birder file written, not its
                                                             # RNG state nor the completion marker)
    {"at": "step", "step": 10, "agents": ["b"], "agent": true}   # every worker of the torchrun agent started with
                                                             # BIRDER_TEST_AGENT=b, and that agent: a lost node

``BIRDER_TEST_EVENTS`` names a file that gets one JSON line per event with its wall-clock time: ``start`` (the
process began), ``first_step`` (training again: this attempt's first step begins, at ``step`` steps done), ``kill``,
``checkpoint`` (``seconds`` this rank spent in the Trainer's ``_save_checkpoint``, ``own_seconds`` of them before the
completion marker's all-gather, which waits for the slowest rank).
"""

import faulthandler
import importlib.util
import json
import os
import signal
import sys
import time

START = time.time()
PLAN = json.loads(os.environ.get("BIRDER_TEST_KILL", "[]"))
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))
NODE = int(os.environ.get("GROUP_RANK", "0"))
AGENT = os.environ.get("BIRDER_TEST_AGENT", "")


def record(event, **fields):
    path = os.environ.get("BIRDER_TEST_EVENTS")
    if path:
        where = {"rank": RANK, "node": NODE, "agent": AGENT, "restart": RESTART}
        line = json.dumps({"event": event, "t": time.time(), **where, **fields})
        with open(path, "a") as f:  # one short append per line: lines of several processes do not interleave
            f.write(line + "\n")


def kill_if_planned(at, step, resumed_at):
    path = os.environ.get("BIRDER_TEST_EVENTS")
    done = set()
    if path and os.path.exists(path):
        with open(path) as f:
            done = {(e["plan"], e["rank"]) for e in map(json.loads, f) if e["event"] == "kill"}
    for index, kill in enumerate(PLAN):
        if (
            (kill["at"], kill["step"]) == (at, step)
            and kill.get("from", resumed_at) == resumed_at
            and (RANK in kill.get("ranks", ()) or AGENT in kill.get("agents", ()))
            and (index, RANK) not in done
        ):
            record("kill", plan=index, at=at, step=step)
            if kill.get("agent"):
                os.kill(os.getppid(), signal.SIGKILL)  # the torchrun agent of this node first
            os.kill(os.getpid(), signal.SIGKILL)


def load_recipe(path):
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main():
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a worker is stuck
    record("start", t=START)
    recipe = load_recipe(sys.argv[1])

    class KillableTrainer(recipe.BirderTrainer):
        resumed_at = None  # steps done when this attempt began training

        def training_step(self, *args, **kwargs):
            if self.resumed_at is None:
                self.resumed_at = self.state.global_step
                record("first_step", step=self.resumed_at)
            kill_if_planned("step", self.state.global_step, self.resumed_at)
            return super().training_step(*args, **kwargs)

        def _save_rng_state(self, output_dir):
            kill_if_planned("save", self.state.global_step, self.resumed_at)
            return super()._save_rng_state(output_dir)

        def _save_checkpoint(self, model, trial):
            began = marking[0] = time.time()
            super()._save_checkpoint(model, trial)
            ended = time.time()
            # own: this rank's writes, until the completion marker's all-gather waits for the other ranks
            record("checkpoint", step=self.state.global_step, seconds=ended - began, own_seconds=marking[0] - began)

    import birder_hf.integrations.transformers as integration

    marking, mark = [0.0], integration.mark_checkpoint_complete

    def timed_mark(*args, **kwargs):
        marking[0] = time.time()
        return mark(*args, **kwargs)

    integration.mark_checkpoint_complete = timed_mark
    recipe.BirderTrainer = KillableTrainer
    recipe.main(sys.argv[2:])
    recipe.release_process_groups()


if __name__ == "__main__":
    main()
