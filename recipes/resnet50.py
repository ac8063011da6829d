# /// script
# requires-python = ">=3.10"
# dependencies = ["birder-hf[recipes]"]
# ///
"""Train a timm image classifier (ResNet-50 by default) with Birder in an accelerate loop.

The paper's ImageNet workload with the official code's schedule (lr 0.004, weight decay 0.1, beta 0.95, lr / 10 every
30 epochs), on an ImageNet-style folder (``--data_dir`` with ``train/<class>/*`` and ``val/<class>/*``).
Without ``--data_dir`` it trains offline on real images the project writes as such a folder (sklearn's
8x8 digits, upscaled).

    # CPU, one machine, 4 processes as 2 simulated nodes x 2:
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/cpu.yaml recipes/resnet50.py --num_nodes 2
    # GPUs, 4 nodes x 8 (the official code's run), on every node with its --machine_rank:
    accelerate launch --config_file accelerate_configs/multi_node_4x8.yaml --machine_rank $NODE_RANK \\
        --main_process_ip $MASTER recipes/resnet50.py --data_dir /data/imagenet --batch_size 256 --epochs 100 \\
        --lr 0.004 --weight_decay 0.1 --beta 0.95 --warmup_epochs 10 --hierarchy --output_dir outputs/resnet50
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import asdict, dataclass, field

import timm
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from timm.data import ImageDataset, create_transform
from timm.optim import param_groups_weight_decay
from tqdm.auto import tqdm
from transformers import HfArgumentParser

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from embedded_data import write_digits_image_folder  # noqa: E402

from birder_hf import Birder, OneBitAdam, Topology  # noqa: E402
from birder_hf.elastic import claim_output_dir  # noqa: E402
from birder_hf.integrations.accelerate import (  # noqa: E402
    check_really_distributed,
    load_resumable_state,
    register_birder_hook,
)
from birder_hf.lifecycle import release_process_groups  # noqa: E402
from birder_hf.model_card import model_card_section  # noqa: E402
from birder_hf.settings import check_settings  # noqa: E402

logger = logging.getLogger("resnet50")


@dataclass
class Args:
    model: str = field(default="resnet50", metadata={"help": "Any timm model name."})
    pretrained: bool = field(default=False, metadata={"help": "Load timm's pretrained weights (needs the Hub)."})
    data_dir: str | None = field(default=None, metadata={"help": "ImageNet-style folder; default: embedded digits."})
    image_size: int | None = field(default=None, metadata={"help": "Input size (default 224, embedded data 32)."})
    output_dir: str = field(default="outputs/resnet50", metadata={"help": "Checkpoints, metrics, final model."})
    epochs: int = field(default=6, metadata={"help": "Training epochs."})
    max_steps: int | None = field(default=None, metadata={"help": "Stop after this many optimizer steps in all."})
    batch_size: int = field(default=32, metadata={"help": "Images per process per step."})
    optimizer: str = field(default="birder", metadata={"help": "birder | onebitadam | sgdm | adamw."})
    lr: float = field(default=0.004, metadata={"help": "Peak learning rate (the seed: 0.004 for Birder)."})
    weight_decay: float = field(default=0.1, metadata={"help": "Decoupled weight decay (not on biases/norms)."})
    beta: float = field(default=0.95, metadata={"help": "Birder's beta."})
    quantize: bool = field(default=True, metadata={"help": "Birder: False sends u itself (one process only)."})
    freeze_step: int = field(default=100, metadata={"help": "onebitadam: full-precision Adam steps first."})
    momentum: float = field(default=0.9, metadata={"help": "sgdm only."})
    warmup_epochs: float = field(default=0.0, metadata={"help": "Linear lr warm-up (the seed: 10 of 100)."})
    lr_step_epochs: int = field(default=30, metadata={"help": "Divide the lr by 10 every this many epochs."})
    method: str = field(default="hierarchical", metadata={"help": "allgather | scatter_gather | hierarchical."})
    hierarchy: bool = field(
        default=False, metadata={"help": "The official code's --hierarchy: --method hierarchical."}
    )
    inter_method: str = field(default="allgather", metadata={"help": "hierarchical: allgather | scatter_gather."})
    num_nodes: int | None = field(default=None, metadata={"help": "Override the node layout (simulate nodes)."})
    chunk_numel: int | None = field(default=None, metadata={"help": "The official code's --all_gather_by_chunks."})
    save_every_epochs: int = field(default=1, metadata={"help": "Checkpoint every this many epochs (0: never)."})
    logging_steps: int = field(default=10, metadata={"help": "Record the training loss every this many steps."})
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "A checkpoint-<step> folder, or auto: the newest one of --output_dir complete on every rank."
        },
    )
    seed: int = field(default=42, metadata={"help": "Seed of everything (data order, init, Birder's bits)."})
    workers: int = field(default=0, metadata={"help": "DataLoader workers per process."})
    push_to_hub: bool = field(default=False, metadata={"help": "Upload the final model folder (needs the Hub)."})
    hub_model_id: str | None = field(default=None, metadata={"help": "Repository for --push_to_hub."})

    def __post_init__(self):
        # everything that can be checked before the first step is checked here: a bad value fails at once
        if self.optimizer not in ("birder", "onebitadam", "sgdm", "adamw"):
            raise ValueError(f"--optimizer must be birder, onebitadam, sgdm or adamw, got {self.optimizer!r}")
        if self.hierarchy:
            self.method = "hierarchical"
        check_settings(self.method, self.inter_method, self.chunk_numel)  # --method, --inter_method, --chunk_numel
        for flag, value, low in (
            ("--epochs", self.epochs, 1),
            ("--batch_size", self.batch_size, 1),
            ("--lr_step_epochs", self.lr_step_epochs, 1),
            ("--logging_steps", self.logging_steps, 1),
            ("--save_every_epochs", self.save_every_epochs, 0),
            ("--workers", self.workers, 0),
        ):
            if value < low:
                raise ValueError(f"{flag} must be >= {low}, got {value}.")
        for flag, value in (
            ("--max_steps", self.max_steps),
            ("--num_nodes", self.num_nodes),
            ("--image_size", self.image_size),  # 0 used to mean the default size
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1 (or left out), got {value}.")
        if self.freeze_step < 1:
            raise ValueError(f"--freeze_step must be >= 1, got {self.freeze_step}.")
        for flag, value, high in (
            ("--warmup_epochs", self.warmup_epochs, math.inf),  # nan and inf used to train at lr 0 or without warm-up
            ("--lr", self.lr, math.inf),
            ("--weight_decay", self.weight_decay, math.inf),
            ("--momentum", self.momentum, math.inf),
            ("--beta", self.beta, 1.0),
        ):
            if not (math.isfinite(value) and 0 <= value < high):
                where = "a finite number >= 0" if high == math.inf else f"in [0, {high:g})"
                raise ValueError(f"{flag} must be {where}, got {value}.")
        if self.data_dir is not None:
            missing = [d for d in ("train", "val") if not os.path.isdir(os.path.join(self.data_dir, d))]
            if missing:
                raise ValueError(
                    f"--data_dir {self.data_dir} has no {' or '.join(m + '/' for m in missing)} folder; it needs "
                    "train/<class>/ and val/<class>/ folders (ImageNet's layout)."
                )


def build_dataloaders(args, accelerator):
    data_dir = args.data_dir
    if data_dir is None:
        data_dir = os.path.join(args.output_dir, "embedded_digits")
        with accelerator.main_process_first():
            write_digits_image_folder(data_dir, image_size=32)
    size = args.image_size if args.image_size is not None else (224 if args.data_dir else 32)
    train = ImageDataset(os.path.join(data_dir, "train"), transform=create_transform(size, is_training=True))
    val = ImageDataset(os.path.join(data_dir, "val"), transform=create_transform(size, is_training=False))
    loader = dict(batch_size=args.batch_size, num_workers=args.workers)
    g = torch.Generator().manual_seed(args.seed)
    train_loader = torch.utils.data.DataLoader(train, shuffle=True, drop_last=True, generator=g, **loader)
    val_loader = torch.utils.data.DataLoader(val, shuffle=False, **loader)
    return train_loader, val_loader, len(train.reader.class_to_idx)


def build_model(args, num_classes):
    return timm.create_model(args.model, pretrained=args.pretrained, num_classes=num_classes)


def build_optimizer(args, model):
    groups = param_groups_weight_decay(model, args.weight_decay)  # no decay on biases and norm weights
    if args.optimizer == "birder":
        return Birder(groups, lr=args.lr, beta=args.beta, quantize=args.quantize, seed=args.seed)
    if args.optimizer == "onebitadam":
        return OneBitAdam(groups, lr=args.lr, freeze_step=args.freeze_step)
    if args.optimizer == "sgdm":
        return torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum)
    return torch.optim.AdamW(groups, lr=args.lr)


def lr_factor(step, steps_per_epoch, args):
    """The official code's schedule: linear warm-up, then / 10 every ``lr_step_epochs`` epochs."""
    epoch = step / steps_per_epoch
    if epoch < args.warmup_epochs:
        return (step + 1) / (args.warmup_epochs * steps_per_epoch)
    return 0.1 ** math.floor(epoch / args.lr_step_epochs)


def evaluate(model, loader, accelerator):
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in loader:
            preds = accelerator.gather_for_metrics(model(images).argmax(-1))
            labels = accelerator.gather_for_metrics(labels)
            correct += (preds == labels).sum().item()
            total += labels.numel()
    model.train()
    return 100.0 * correct / max(total, 1)


def train(args):
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    check_really_distributed(accelerator.num_processes)  # the accelerate --multi_gpu-on-CPU trap
    if args.num_nodes and accelerator.num_processes % args.num_nodes:
        raise ValueError(f"--num_nodes {args.num_nodes} does not divide the {accelerator.num_processes} processes.")
    if not accelerator.is_main_process:
        logging.getLogger().setLevel(logging.WARNING)
    set_seed(args.seed)
    train_loader, val_loader, num_classes = build_dataloaders(args, accelerator)
    model = build_model(args, num_classes)
    optimizer = build_optimizer(args, model)
    model, optimizer, train_loader, val_loader = accelerator.prepare(model, optimizer, train_loader, val_loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, len(train_loader), args))
    progress = Progress()
    accelerator.register_for_checkpointing(scheduler, progress)  # inside save_state: before the completion marker
    hook_state = None
    if args.optimizer in ("birder", "onebitadam"):  # the 1-bit hook (and per-rank state in save/load_state)
        topology = None
        if args.num_nodes and accelerator.num_processes > 1:
            topology = Topology.from_layout(args.num_nodes, accelerator.num_processes // args.num_nodes)
        hook_state = register_birder_hook(
            accelerator,
            model,
            optimizer,
            topology=topology,
            method=args.method,
            inter_method=args.inter_method,
            chunk_numel=args.chunk_numel,
        )
    logger.info(
        "world size %d, %s, optimizer %s, %s",
        accelerator.num_processes,
        args.model,
        args.optimizer,
        hook_state.topology if hook_state else "no 1-bit hook",
    )

    steps_per_epoch = len(train_loader)
    total_steps = args.epochs * steps_per_epoch if args.max_steps is None else args.max_steps
    # this job's output_dir (another job writing it, or a folder it cannot write, stops every rank now)
    claim_output_dir(args.output_dir, world_size=accelerator.num_processes)
    if args.resume_from_checkpoint == "auto":  # an elastic restart: the newest complete checkpoint, or a fresh start
        if hook_state is None:
            what = f"--resume_from_checkpoint auto with --optimizer {args.optimizer}: only Birder's checkpoints carry "
            what += "completion markers"
            raise ValueError(f"{what}; pass the checkpoint folder itself.")
        load_resumable_state(accelerator, args.output_dir)
    elif args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
    step = progress.step
    history, steps_log, loss_sum, loss_n, window = [], [], 0.0, 0, []
    bar = tqdm(total=total_steps, initial=step, disable=not accelerator.is_main_process, desc="train")
    model.train()
    while step < total_steps:
        epoch, offset = divmod(step, steps_per_epoch)
        train_loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(train_loader, offset) if offset else train_loader
        for images, labels in batches:
            loss = torch.nn.functional.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            value = loss.item()
            loss_sum, loss_n = loss_sum + value, loss_n + 1
            window.append(value)
            if step % args.logging_steps == 0:  # this rank's mean loss over the last logging_steps steps
                steps_log.append({"step": step, "train_loss": sum(window) / len(window)})
                window = []
            bar.update(1)
            bar.set_postfix(loss=f"{value:.3f}")
            if step % steps_per_epoch == 0 or step == total_steps:
                record = {
                    "epoch": step / steps_per_epoch,
                    "step": step,
                    "train_loss": loss_sum / loss_n,
                    "val_top1": evaluate(model, val_loader, accelerator),
                    "lr": scheduler.get_last_lr()[0],
                }
                if hook_state is not None:
                    record.update(hook_state.stats.as_dict("comm/"))
                history.append(record)
                loss_sum, loss_n = 0.0, 0
                logger.info("epoch %.2f: %s", record["epoch"], json.dumps(record))
                if args.save_every_epochs and step % (args.save_every_epochs * steps_per_epoch) == 0:
                    progress.step = step
                    accelerator.save_state(os.path.join(args.output_dir, f"checkpoint-{step}"))
            if step >= total_steps:
                break
    bar.close()
    return finish(accelerator, args, model, optimizer, history, hook_state, steps_log)


class Progress:
    """The training step, saved by ``accelerator.save_state`` beside the model, rank 0's optimizer, the scheduler and
    the RNGs (Birder: every rank's own state), so inside the checkpoint its completion marker covers."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def finish(accelerator, args, model, optimizer, history, hook_state, steps_log=()):
    results = {
        "world_size": accelerator.num_processes,
        "optimizer": args.optimizer,
        "model": args.model,
        "args": asdict(args),
        "epochs": history,
        "steps": list(steps_log),  # rank 0's training loss every logging_steps steps (of this run, after a resume)
        **{f"final_{k}": v for k, v in history[-1].items()},
    }
    if hook_state is not None:
        results["comm/topology"] = repr(hook_state.topology)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(args.output_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in history)
        save_model(accelerator, args, model, optimizer, results)
        print(
            f"top-1 {history[-1]['val_top1']:.1f}% after {history[-1]['epoch']:.2f} epochs "
            f"({args.optimizer}, world size {accelerator.num_processes})",
            flush=True,
        )
    accelerator.wait_for_everyone()
    return results


def save_model(accelerator, args, model, optimizer, results):
    """Hub-ready folder: timm's config.json + model.safetensors and a model card naming Birder."""
    from timm.models import save_for_hf

    folder = os.path.join(args.output_dir, "model")
    save_for_hf(accelerator.unwrap_model(model), folder, safe_serialization=True)
    card = [
        f"---\nlibrary_name: timm\ntags: [image-classification, timm, birder]\n---\n# {args.model}\n",
        f"Top-1 {results['final_val_top1']:.2f}% on {args.data_dir or 'the embedded digits'}.\n",
    ]
    if args.optimizer in ("birder", "onebitadam"):
        communication = dict(method=args.method, inter_method=args.inter_method, chunk_numel=args.chunk_numel)
        card.append(model_card_section(optimizer, communication if args.optimizer == "birder" else None))
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(card))
    if args.push_to_hub:
        from huggingface_hub import HfApi

        api = HfApi()
        repo = api.create_repo(args.hub_model_id or os.path.basename(args.output_dir), exist_ok=True)
        api.upload_folder(repo_id=repo.repo_id, folder_path=folder, commit_message="Birder training run")


def main(argv=None):
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses(args=argv)
    return train(args)


if __name__ == "__main__":
    main()
    release_process_groups()  # every rank's groups released before the interpreter ends (a clean exit status)
