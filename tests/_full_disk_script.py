"""Run by tests/test_bad_input.py inside a private mount namespace, with argv[1] a small tmpfs: a full disk during
save_rank_state, accelerate's save_state and the Trainer's checkpoint. Prints one JSON line per case."""

import json
import os
import sys

import torch

from birder_hf import Birder
from birder_hf.checkpoint import load_rank_state, save_rank_state

DISK = sys.argv[1]


def fill(leave: int) -> None:
    """Fill the disk, then free ``leave`` bytes."""
    filler = os.path.join(DISK, f"filler-{len(os.listdir(DISK))}")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    os.truncate(filler, max(0, os.path.getsize(filler) - leave))


def report(case: str, exc: BaseException | None, **extra) -> None:
    out = {"case": case, "errno": getattr(exc, "errno", None), "type": type(exc).__name__, "message": str(exc)}
    print("RESULT", json.dumps({**out, **extra}), flush=True)


def model_and_optimizer():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8192))  # m and b: 64 KiB of state
    return p, Birder([p], lr=0.1, seed=0)


# 1) save_rank_state: the previous file stays, loadable
p, opt = model_and_optimizer()
p.grad = torch.randn(8192)
opt.step()
path = save_rank_state(opt, os.path.join(DISK, "direct"), rank=0, world_size=1)
with open(path, "rb") as f:
    first = f.read()
fill(leave=8192)
p.grad = torch.randn(8192)
opt.step()
try:
    save_rank_state(opt, os.path.join(DISK, "direct"), rank=0, world_size=1)
    report("save_rank_state", None)
except OSError as exc:
    with open(path, "rb") as f:
        unchanged = f.read() == first
    q, fresh = model_and_optimizer()
    load_rank_state(fresh, os.path.join(DISK, "direct"), rank=0, world_size=1)
    report("save_rank_state", exc, unchanged=unchanged, loaded_step=int(fresh.state[q]["step"]), path=path)

# 2) accelerate's save_state: Birder's per-rank state is written first, and says the disk is full
for name in os.listdir(DISK):
    if name.startswith("filler"):
        os.remove(os.path.join(DISK, name))
from accelerate import Accelerator  # noqa: E402

from birder_hf.integrations.accelerate import register_birder_hook  # noqa: E402

acc = Accelerator(cpu=True)
model = torch.nn.Linear(64, 64)
prepared, aopt = acc.prepare(model, Birder(model.parameters(), lr=0.1, seed=0))
register_birder_hook(acc, prepared, aopt)
prepared(torch.randn(4, 64)).square().mean().backward()
aopt.step()
fill(leave=4096)
try:
    acc.save_state(os.path.join(DISK, "accelerate"))
    report("accelerate", None)
except OSError as exc:
    report("accelerate", exc)

# 3) the Trainer: a checkpoint that fills the disk says so, and which one is incomplete
for name in os.listdir(DISK):
    if name.startswith("filler"):
        os.remove(os.path.join(DISK, name))
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from birder_hf.integrations.transformers import BirderArguments, BirderTrainer  # noqa: E402


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        return {"loss": (self.layer(x).squeeze(-1) - y).square().mean()}


class FillAfterFirstSave(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 1:
            fill(leave=1024)


data = [{"x": torch.randn(8), "y": torch.randn(())} for _ in range(8)]
args = TrainingArguments(
    output_dir=os.path.join(DISK, "trainer"),
    max_steps=2,
    save_steps=1,
    per_device_train_batch_size=4,
    use_cpu=True,
    report_to=[],
    logging_steps=1,
    disable_tqdm=True,
)
trainer = BirderTrainer(
    model=Tiny(), args=args, train_dataset=data, birder_args=BirderArguments(), callbacks=[FillAfterFirstSave()]
)
try:
    trainer.train()
    report("trainer", None)
except OSError as exc:
    report("trainer", exc, first=sorted(os.listdir(os.path.join(DISK, "trainer", "checkpoint-1"))))
