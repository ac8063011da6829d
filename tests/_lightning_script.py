"""Worker of ``tests/test_lightning.py``: ``Trainer(accelerator="cpu", devices=2)`` re-launches it as 2 processes.

Usage: ``python tests/_lightning_script.py OUT_DIR``. Every rank runs the same fits, one after the other, in one launch
(Lightning launches the second process once; later Trainers reuse the process group), and writes what the test checks
into OUT_DIR:

- ``full``: 4 epochs = 8 optimizer steps (2 micro-batches each: accumulate_grad_batches=2), CSVLogger;
- ``first``: the first 2 epochs (4 steps), ModelCheckpoint keeping the last epoch only;
- ``resume``: ``fit(ckpt_path=<epoch 1>)`` up to 4 epochs; must equal ``full`` bit for bit on every rank;
- ``nodes2x1``: ``hierarchy_num_nodes=2``: the 2 processes as 2 nodes x 1 rank;
- ``onebitadam``: OneBitAdam through the same strategy;
- ``refused``: an AdamW optimizer; every rank must raise the strategy's TypeError at setup;
- ``fp16``, ``fp16-scale1``: ``precision="16-mixed"`` through Lightning's ``MixedPrecision`` plugin with a
  ``GradScaler("cpu")`` of initial scale 2**12 and 1 (the ``precision="16-mixed"`` flag becomes bf16-mixed on CPU; the
  plugin runs the control flow a GPU run takes);
- elastic restarts: ``auto-first`` saves every epoch (``save_top_k=-1``, ``save_last=True``) for 2 epochs; the
  step-4 checkpoints (``epoch=1-step=4.ckpt`` and the rewritten ``last.ckpt``) are then broken as a save killed midway
  leaves them (rank 1's Birder file and the marker gone); ``last-refused``: ``ckpt_path="last"`` must be refused on
  every rank; ``auto``: ``ckpt_path=find_resumable_lightning_checkpoint(...)`` up to 4 epochs, ``manual``: the same
  from the path it should choose; ``save-fails``: rank 1 cannot write its Birder file, every rank must fail.
"""

import json
import os
import sys
import traceback

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from birder_hf import Birder, OneBitAdam
from birder_hf.integrations.lightning import BirderDDPStrategy, birder_state_dir, find_resumable_lightning_checkpoint

OUT = sys.argv[1]


class Net(pl.LightningModule):
    def __init__(self, optimizer: str = "birder"):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        if self.optimizer == "birder":
            return Birder(self.parameters(), lr=1e-2, beta=0.9, weight_decay=0.01, seed=3)
        if self.optimizer == "onebitadam":
            return OneBitAdam(self.parameters(), lr=1e-3, freeze_step=2)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = 0.5 * x[:, :1] + 0.1 * torch.randn(64, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)  # 4 micro-batches per rank and epoch


def fit(tag: str, optimizer: str = "birder", strategy_kwargs=None, ckpt_path=None, **trainer_kwargs):
    pl.seed_everything(0, verbose=False)
    model = Net(optimizer)
    strategy = BirderDDPStrategy(method="hierarchical", **(strategy_kwargs or {}))
    kwargs = dict(logger=False, enable_checkpointing=False)
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        accumulate_grad_batches=2,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=OUT,
        **kwargs,
    )
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    state = strategy.birder_hook_state
    torch.save(
        {
            "params": [p.detach().clone() for p in model.parameters()],
            "optimizer": trainer.optimizers[0].state_dict(),
            "topology": repr(state.topology),
            "bytes_sent": state.stats.total_bytes,
            "global_step": trainer.global_step,
            "skipped_steps": state.skipped_steps,
            "precision": type(trainer.precision_plugin).__name__ + " " + str(trainer.precision),
            "scale": getattr(getattr(trainer.precision_plugin, "scaler", None), "get_scale", lambda: None)(),
        },
        os.path.join(OUT, f"{tag}-rank{trainer.global_rank}.pt"),
    )
    return trainer


fit("full", max_epochs=4, logger=CSVLogger(OUT, name="csv"), log_every_n_steps=1)
ckpt_dir = os.path.join(OUT, "ckpt")
fit("first", max_epochs=2, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_top_k=1)])
fit("resume", max_epochs=4, ckpt_path=os.path.join(ckpt_dir, "epoch=1-step=4.ckpt"))
fit("nodes2x1", max_epochs=1, strategy_kwargs={"hierarchy_num_nodes": 2})
fit("onebitadam", "onebitadam", max_epochs=1)
try:
    fit("refused", "adamw", max_epochs=1)
    refusal = None
except TypeError as exc:
    refusal = str(exc)
for tag, scale in (("fp16", 2.0**12), ("fp16-scale1", 1.0)):
    amp = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=scale))
    fit(tag, max_epochs=2, plugins=[amp])
rank = int(os.environ.get("LOCAL_RANK", 0))
with open(os.path.join(OUT, f"refused-rank{rank}.json"), "w") as f:
    json.dump({"error": refusal}, f)


def failed(tag, **kwargs):
    try:
        fit(tag, **kwargs)
        return None
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}" + ("" if isinstance(exc, RuntimeError) else traceback.format_exc())


# elastic restarts
auto_dir = os.path.join(OUT, "auto")
every_epoch = dict(dirpath=auto_dir, save_top_k=-1, save_last=True)
fit("auto-first", max_epochs=2, enable_checkpointing=True, callbacks=[ModelCheckpoint(**every_epoch)])
torch.distributed.barrier()
if rank == 0:  # the save of step 4 killed midway
    for name in ("epoch=1-step=4.ckpt", "last.ckpt"):
        folder = birder_state_dir(os.path.join(auto_dir, name))
        os.unlink(os.path.join(folder, "birder_complete.json"))
        os.unlink(os.path.join(folder, "birder", "rank_00001-of-00002.pt"))
torch.distributed.barrier()
with_callback = dict(enable_checkpointing=True, callbacks=[ModelCheckpoint(**every_epoch)])
errors = {"last-refused": failed("last-refused", max_epochs=4, ckpt_path="last", **with_callback)}
chosen = find_resumable_lightning_checkpoint(auto_dir)
fit("auto", max_epochs=4, ckpt_path=chosen)
fit("manual", max_epochs=4, ckpt_path=os.path.join(auto_dir, "epoch=0-step=2.ckpt"))
blocked = os.path.join(OUT, "blocked")
if rank == 0:  # a folder where rank 1's Birder file of the first checkpoint goes: its write fails
    os.makedirs(os.path.join(blocked, "epoch=0-step=2.ckpt.birder", "birder", "rank_00001-of-00002.pt"))
torch.distributed.barrier()
errors["save-fails"] = failed(
    "save-fails", max_epochs=1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=blocked)]
)
with open(os.path.join(OUT, f"elastic-rank{rank}.json"), "w") as f:
    json.dump({"chosen": chosen, **errors}, f)
