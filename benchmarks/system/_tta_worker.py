"""One rank of a time-to-accuracy run: a recipe's task trained with one gradient-communication method.

Launched by ``benchmarks/system/tta.py`` with ``torchrun`` (on loopback, or in every node of a testbed), or by hand::

    torchrun --standalone --nproc_per_node 4 benchmarks/system/_tta_worker.py --task qa --method birder-h \
        --nodes 2 --steps 60 --eval-every 20 --lr 4e-3 --out /tmp/tta.jsonl

The tasks are the recipes' embedded ones, built from the recipes' own code: ``qa`` (tiny BERT on the embedded
SQuAD-format set, SQuAD F1: ``recipes/bert_base.py``), ``image`` (timm ResNet-18 on the embedded digits, top-1:
``recipes/resnet50.py``) and ``lm`` (the causal-LM recipe's tiny GPT-2 on the standard library's source,
validation perplexity: ``recipes/causal_lm.py``). Every method trains the same model from the same initial
weights on the same batches, with the same learning-rate schedule (linear warm-up over 5% of the steps, or
``--lr-warmup``, then linear decay to 0):

- ``fp32``: DDP's fp32 all-reduce with the task's usual optimizer (AdamW; SGD with momentum for ``image``);
- ``fp16``: torch's ``fp16_compress_hook``, same optimizer;
- ``powersgd-r1`` / ``powersgd-r4``: torch's PowerSGD hook, rank 1 / 4, with its usual warm-up: fp32 all-reduce for
  the first ``--warmup-frac`` of the steps (``start_powerSGD_iter``), error feedback and warm start on;
- ``onebitadam``: birder-hf's 1-bit Adam (fp32 Adam for the first ``--warmup-frac`` of the steps, then 1-bit);
- ``birder-h`` / ``birder-flat``: Birder with the hierarchical / flat (allgather) 1-bit all-reduce, no warm-up.

Timing excludes evaluation: every rank stops its clock before an evaluation and restarts it after. Rank 0 appends one
JSON line per evaluation (step, seconds of training so far, the metrics, the mean training loss since the last
evaluation) and a final record with every step's duration, to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tta import METHODS  # noqa: E402  (the harness's list: one place)

from birder_hf import Birder, LocalSteps, OneBitAdam, Topology, attach_ddp_hook  # noqa: E402

TASKS = ("qa", "image", "lm")
# local-step methods: H inner AdamW / SGDM steps per outer step, the outer exchange, and its (lr, momentum) per task:
# the recipes' choice per exchange on that task's seeds 0-2 (docs/results/recipe_matrix_qa_local_h10_tune.json,
# recipe_matrix_lm_local_h10_tune.json); the image task, where none was chosen, takes QA's
LOCAL = {"local10": (10, "onebit"), "local10-fp32": (10, "fp32")}
OUTER = {"local10": {"qa": (0.7, 0.5), "lm": (1.0, 0.0)}, "local10-fp32": {"qa": (0.4, 0.8), "lm": (0.5, 0.5)}}


def local_setup(method: str, task: str) -> tuple[int, str, float, float]:
    """``(H, exchange, outer_lr, outer_momentum)`` of a local-step method on ``task``."""
    return *LOCAL[method], *OUTER[method].get(task, OUTER[method]["qa"])


PRIMARY = {"qa": ("f1", True), "image": ("top1", True), "lm": ("perplexity", False)}  # metric, higher is better


# ----------------------------------------------------------------------------------------------------------- tasks
class Task:
    """A model, the rank's batches, the loss, and an evaluation (rank 0) returning a dict of metrics."""

    name: str
    model: torch.nn.Module

    def batch(self, step: int) -> dict:
        raise NotImplementedError

    def loss(self, model, batch) -> torch.Tensor:
        raise NotImplementedError

    def evaluate(self, model) -> dict:
        raise NotImplementedError


def _shard(n: int, step: int, batch: int, rank: int, world: int, seed: int) -> torch.Tensor:
    """This rank's indices for global step ``step`` (1-based): a fresh permutation per epoch, split by rank."""
    per_step = batch * world
    steps_per_epoch = n // per_step
    epoch, k = divmod(step - 1, steps_per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1000 * seed + epoch))
    start = k * per_step + rank * batch
    return perm[start : start + batch]


class QATask(Task):
    def __init__(self, args, rank, world, work: Path):
        from bert_base import MODEL_CONFIGS
        from embedded_data import build_wordpiece_tokenizer, load_squad_json, make_squad_dataset
        from qa_utils import prepare_eval_features, prepare_train_features
        from transformers import BertConfig, BertForQuestionAnswering

        self.name, self.args, self.rank, self.world = "qa", args, rank, world
        folder = work / "qa_data"
        if rank == 0:
            make_squad_dataset(folder, args.qa_train, args.qa_eval, seed=0)
        dist.barrier()
        train_raw = load_squad_json(folder / "train.json")
        self.eval_raw = load_squad_json(folder / "dev.json")
        # a pure function of the texts: every rank builds the same vocabulary (recipes/embedded_data.py)
        self.tokenizer = build_wordpiece_tokenizer(sorted(set(train_raw["context"])) + list(train_raw["question"]))
        window = dict(tokenizer=self.tokenizer, max_seq_length=128, doc_stride=64)
        train = train_raw.map(
            prepare_train_features, batched=True, remove_columns=train_raw.column_names, fn_kwargs=window
        )
        self.eval_features = self.eval_raw.map(
            prepare_eval_features, batched=True, remove_columns=self.eval_raw.column_names, fn_kwargs=window
        )
        cols = ("input_ids", "attention_mask", "token_type_ids", "start_positions", "end_positions")
        self.train = {c: torch.tensor(train[c]) for c in cols}
        torch.manual_seed(args.seed)
        config = BertConfig(vocab_size=len(self.tokenizer), **MODEL_CONFIGS["tiny"])
        self.model = BertForQuestionAnswering(config)

    def batch(self, step):
        idx = _shard(len(self.train["input_ids"]), step, self.args.batch, self.rank, self.world, self.args.seed)
        return {k: v[idx] for k, v in self.train.items()}

    def loss(self, model, batch):
        return model(**batch).loss

    def evaluate(self, model):
        from qa_utils import postprocess_qa_predictions, squad_metrics

        feats = self.eval_features.remove_columns(["example_id", "offset_mapping"])
        starts, ends = [], []
        with torch.no_grad():
            for i in range(0, len(feats), 128):
                chunk = feats[i : i + 128]
                out = model(**{k: torch.tensor(chunk[k]) for k in ("input_ids", "attention_mask", "token_type_ids")})
                starts.append(out.start_logits)
                ends.append(out.end_logits)
        preds = postprocess_qa_predictions(
            self.eval_raw, self.eval_features, torch.cat(starts).numpy(), torch.cat(ends).numpy(), 20, 30
        )
        m = squad_metrics(preds, self.eval_raw)
        return {"f1": m["f1"], "exact_match": m["exact_match"]}


class ImageTask(Task):
    def __init__(self, args, rank, world, work: Path):
        import timm
        from embedded_data import write_digits_image_folder
        from timm.data import ImageDataset, create_transform

        self.name, self.args, self.rank, self.world = "image", args, rank, world
        folder = work / "digits"
        if rank == 0:
            write_digits_image_folder(folder, image_size=32)
        dist.barrier()
        # decoded once (the recipe's evaluation transform, no augmentation: every method sees the same pixels)
        tf = create_transform(32, is_training=False)
        train = ImageDataset(str(folder / "train"), transform=tf)
        val = ImageDataset(str(folder / "val"), transform=tf)
        self.x, self.y = (torch.stack(t) for t in zip(*[(x, torch.tensor(y)) for x, y in train]))
        self.vx, self.vy = (torch.stack(t) for t in zip(*[(x, torch.tensor(y)) for x, y in val]))
        torch.manual_seed(args.seed)
        self.model = timm.create_model("resnet18", pretrained=False, num_classes=10)

    def batch(self, step):
        idx = _shard(len(self.y), step, self.args.batch, self.rank, self.world, self.args.seed)
        return {"x": self.x[idx], "y": self.y[idx]}

    def loss(self, model, batch):
        return F.cross_entropy(model(batch["x"]), batch["y"])

    def evaluate(self, model):
        with torch.no_grad():
            pred = torch.cat([model(self.vx[i : i + 256]).argmax(-1) for i in range(0, len(self.vy), 256)])
        return {"top1": 100.0 * (pred == self.vy).float().mean().item()}


class LMTask(Task):
    """The causal-LM recipe's task (``recipes/causal_lm.py``): its ``tiny`` GPT-2 on the standard library's source,
    a byte-level BPE vocabulary of 4096 and blocks of 128 tokens (``recipes/stdlib_text.py``); validation perplexity
    over 256 evenly spaced held-out blocks."""

    def __init__(self, args, rank, world, work: Path):
        from causal_lm import MODEL_CONFIGS
        from stdlib_text import read_split, stdlib_corpus, token_blocks, train_bpe_tokenizer
        from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

        self.name, self.args, self.rank, self.world = "lm", args, rank, world
        folder = work / "lm_data"
        if rank == 0 and not (folder / "blocks.pt").exists():
            folder.mkdir(parents=True, exist_ok=True)
            corpus = stdlib_corpus(5)
            tokenizer = train_bpe_tokenizer(read_split(corpus, "train"), 4096, out_dir=str(folder))
            blocks = {s: token_blocks(tokenizer, read_split(corpus, s), 128) for s in ("train", "validation")}
            torch.save(blocks, folder / ".blocks.pt")
            os.replace(folder / ".blocks.pt", folder / "blocks.pt")
        dist.barrier()
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
        blocks = torch.load(folder / "blocks.pt", weights_only=True)
        self.train_ids = blocks["train"]
        val = blocks["validation"]
        self.eval_ids = val[torch.linspace(0, len(val) - 1, min(256, len(val))).long()]
        torch.manual_seed(args.seed)
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=128,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **MODEL_CONFIGS["tiny"],
        )
        self.model = GPT2LMHeadModel(config)

    def batch(self, step):
        idx = _shard(len(self.train_ids), step, self.args.batch, self.rank, self.world, self.args.seed)
        ids = self.train_ids[idx]
        return {"input_ids": ids, "labels": ids}

    def loss(self, model, batch):
        return model(**batch).loss

    def evaluate(self, model):
        losses = []
        with torch.no_grad():
            for i in range(0, len(self.eval_ids), 32):
                ids = self.eval_ids[i : i + 32]
                losses.append(model(input_ids=ids, labels=ids).loss * len(ids))
        loss = (torch.stack(losses).sum() / len(self.eval_ids)).item()
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def build_task(name, args, rank, world, work) -> Task:
    return {"qa": QATask, "image": ImageTask, "lm": LMTask}[name](args, rank, world, work)


# --------------------------------------------------------------------------------------------------------- methods
def base_optimizer(task: str, params, lr: float):
    if task == "image":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)


def setup_method(method: str, task: Task, ddp: DDP, args, topo: Topology):
    """The optimizer of ``method``, with its communication hook registered on ``ddp``, and the LocalSteps of a
    local-step method (else None)."""
    params, warmup = ddp.parameters(), max(2, round(args.warmup_frac * args.steps))
    if method in LOCAL:
        h, exchange, outer_lr, outer_momentum = local_setup(method, task.name)
        opt = base_optimizer(task.name, params, args.lr)
        local = LocalSteps(ddp, opt, local_steps=h, exchange=exchange, outer_lr=outer_lr,
                           outer_momentum=outer_momentum, topology=topo, seed=args.seed)  # fmt: skip
        return opt, local
    if method in ("fp32", "fp16") or method.startswith("powersgd"):
        opt = base_optimizer(task.name, params, args.lr)
        if method == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method.startswith("powersgd"):
            from _throughput_worker import Chain, chained_hook  # gloo: one bucket's collectives at a time

            state = psgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=int(method[-1]),
                start_powerSGD_iter=warmup,
                random_seed=args.seed,
            )
            ddp.register_comm_hook(Chain(psgd.powerSGD_hook, state), chained_hook)
        return opt, None
    wd = 0.1 if task.name == "image" else 0.01
    if method == "onebitadam":
        opt = OneBitAdam(params, lr=args.lr, weight_decay=wd, freeze_step=warmup)
    else:
        opt = Birder(params, lr=args.lr, beta=0.95, weight_decay=wd, seed=args.seed, **json.loads(args.birder_options))
    attach_ddp_hook(ddp, opt, topology=topo, method="allgather" if method == "birder-flat" else "hierarchical")
    return opt, None


def lr_lambda(steps: int, warmup: float = 0.05):
    """Linear warm-up over ``warmup`` of the steps, then linear decay to 0 at ``steps``."""
    warm = max(1, round(warmup * steps))
    return lambda s: (s + 1) / warm if s < warm else max(0.0, (steps - s) / max(1, steps - warm))


# ------------------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=TASKS, required=True)
    ap.add_argument("--method", choices=METHODS, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--eval-every", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=16, help="samples per process per step")
    ap.add_argument("--nodes", type=int, default=None, help="simulate this many nodes (default: the launcher's)")
    ap.add_argument("--warmup-frac", type=float, default=0.1, help="PowerSGD / 1-bit Adam fp32 warm-up share")
    ap.add_argument("--lr-warmup", type=float, default=0.05, help="linear learning-rate warm-up share of the steps")
    ap.add_argument("--qa-train", type=int, default=2400)
    ap.add_argument("--qa-eval", type=int, default=240)
    ap.add_argument("--no-eval", action="store_true", help="time the steps only (evaluate once at the end)")
    ap.add_argument("--work", default=None, help="folder for the generated data (default: next to --out)")
    ap.add_argument("--birder-options", default="{}", help='JSON keyword arguments for Birder, e.g. {"amsgrad": true}')
    ap.add_argument("--tag", default="", help="JSON object merged into every record")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.nodes:
        topo = Topology.from_layout(args.nodes, world // args.nodes)
    else:
        topo = Topology.from_env() if "LOCAL_WORLD_SIZE" in os.environ else Topology.flat()
    work = Path(args.work or Path(args.out).parent)
    task = build_task(args.task, args, rank, world, work)
    onebit_outer = args.method in LOCAL and LOCAL[args.method][1] == "onebit"
    if args.method.startswith("birder") or args.method == "onebitadam" or onebit_outer:
        # compile the codec kernels before the clock starts: a one-off cost per process, not per step
        from _throughput_worker import warm_codec

        solo_group, _ = dist.new_subgroups(group_size=1)
        warm_codec(Topology.flat(solo_group), sum(p.numel() for p in task.model.parameters()))
        if onebit_outer:  # and those of the outer exchange, on a copy of the model
            probe = copy.deepcopy(task.model)
            LocalSteps(probe, torch.optim.SGD(probe.parameters(), lr=0.0), local_steps=1,
                       topology=Topology.flat(solo_group)).step()  # fmt: skip
    ddp = DDP(task.model, init_sync=False)  # same seed everywhere: identical initial weights
    opt, local = setup_method(args.method, task, ddp, args, topo)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.steps, args.lr_warmup))
    tag = json.loads(args.tag) if args.tag else {}
    base = dict(
        tag,
        task=args.task,
        method=args.method,
        lr=args.lr,
        seed=args.seed,
        steps=args.steps,
        world_size=world,
        topology=repr(topo),
        batch_per_proc=args.batch,
        lr_warmup=args.lr_warmup,
    )
    if local is not None:
        setup = local_setup(args.method, args.task)
        base["local_steps"], base["outer_exchange"], base["outer_lr"], base["outer_momentum"] = setup

    def emit(rec):
        if rank == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps({**base, **rec}) + "\n")

    def evaluate(step, train_s, losses):
        dist.barrier()
        if rank == 0:
            task.model.eval()
            metrics = task.evaluate(task.model)
            task.model.train()
            emit(
                {
                    "kind": "eval",
                    "step": step,
                    "train_s": train_s,
                    "train_loss": sum(losses) / max(1, len(losses)),
                    **metrics,
                }
            )
            print(
                f"[tta] {args.task} {args.method} lr {args.lr} seed {args.seed} step {step} {train_s:.1f} s {metrics}",
                flush=True,
            )
        dist.barrier()

    evaluate(0, 0.0, [])
    step_s, losses, train_s = [], [], 0.0
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss = task.loss(ddp, task.batch(step))
        loss.backward()
        opt.step()
        if local is not None:
            local.step()  # every H-th step: the exchange and the outer step
        sched.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        step_s.append(dt)
        train_s += dt
        losses.append(loss.item())
        if step == args.steps or (not args.no_eval and step % args.eval_every == 0):
            evaluate(step, train_s, losses)
            losses = []
    # the slowest rank per step: DDP keeps the ranks in lock step, the rest is skew at the last bucket
    all_steps = [None] * world
    dist.all_gather_object(all_steps, step_s)
    emit(
        {
            "kind": "done",
            "step_s": [max(r[i] for r in all_steps) for i in range(args.steps)],
            # a local-step method's ranks meet only at the exchange, where the fast ones wait for the slow: its
            # time is per round (tta.py), and the slowest rank per step would count the skew twice
            **({"step_s_per_rank": all_steps} if local is not None else {}),
            "loadavg_1min": os.getloadavg()[0],
        }
    )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
