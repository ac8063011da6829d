# /// script
# requires-python = ">=3.10"
# dependencies = ["birder-hf[recipes]"]
# ///
"""Train a GPT-2-style causal language model with Birder through the HF Trainer: DDP or 1-bit HSDP.

Offline by default: the text is the Python standard library's own source (every Python ships it; tests and
site-packages left out, ~12 MB), with a byte-level BPE tokenizer trained here, a fixed train/validation split by file
name (recorded with each file's SHA-256 in ``data_manifest.json``) and validation perplexity in ``all_results.json``.

    # CPU, 4 processes as 2 simulated nodes x 2: FSDP2 inside each node, Birder's 1 bit across the nodes
    torchrun --standalone --nproc_per_node 4 recipes/causal_lm.py --sharding hsdp --num_nodes 2
    # the same with DDP (every rank holds the whole model; hierarchical 1-bit all-reduce)
    torchrun --standalone --nproc_per_node 4 recipes/causal_lm.py --num_nodes 2
    # baselines: --optimizer adamw (HSDP: native HSDP, full precision across nodes; DDP: fp32 all-reduce),
    # --optimizer onebitadam (DDP only)
    # GPUs, 4 nodes x 8, GPT-2 (124M) from the Hub with 1-bit HSDP:
    accelerate launch --config_file accelerate_configs/multi_node_4x8.yaml --machine_rank $NODE_RANK \\
        --main_process_ip $MASTER recipes/causal_lm.py --model_name_or_path gpt2 --sharding hsdp --bf16 \\
        --block_size 1024 --per_device_train_batch_size 8 --max_steps 20000 --output_dir outputs/gpt2_hsdp

Any `TrainingArguments` flag works; a single .json or .yaml argument is read as the whole configuration.
`--resume_from_checkpoint auto` resumes from the newest checkpoint complete on every rank (elastic restarts:
docs/SETUPS.md, "Fault tolerance").
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recipe_args import (  # noqa: E402
    check_local_steps,
    given_flags,
    is_config_file,
    local_steps_metrics,
    parse_recipe_args,
    voters,
)
from stdlib_text import read_split, stdlib_corpus, token_blocks, train_bpe_tokenizer  # noqa: E402

from birder_hf.base import local_tensor, unwrap_optimizer  # noqa: E402
from birder_hf.integrations.accelerate import check_elastic_restart, check_really_distributed  # noqa: E402
from birder_hf.integrations.transformers import (  # noqa: E402
    BirderArguments,
    BirderTrainer,
    HSDPTrainer,
    LocalStepsArguments,
    LocalStepsTrainer,
)
from birder_hf.lifecycle import release_process_groups  # noqa: E402

logger = logging.getLogger("causal_lm")

MODEL_CONFIGS = {
    "tiny": dict(n_embd=128, n_layer=4, n_head=4),  # ~1.3M parameters with a 4096-token vocabulary
    "small": dict(n_embd=256, n_layer=6, n_head=8),  # ~5.8M
    "gpt2": dict(n_embd=768, n_layer=12, n_head=12),  # GPT-2 small's shape (124M with its 50257 tokens)
}

# Without --learning_rate: AdamW and 1-bit Adam (its Adam warm-up) 2e-3; Birder's rate comes with its update rule.
DEFAULT_LR = {"adamw": 2e-3, "onebitadam": 2e-3}

# --update_rule: the Birder settings it supplies where the command line gives none.
# - "adam" (the default here): vote on Adam's direction clipped to [-1, 1], each rank's gradient clipped to its share
#   of a norm of 1.0; learning rate 1e-3 per voting worker (see rule_learning_rate).
# - "birder": the paper's rule, u = m / b with beta 0.95, lr 5e-4 (the best of 2e-3 / 5e-4 / 2e-4 for that rule:
#   docs/results/hsdp_lr_check_birder_*.json); this recipe's default until the "adam" rule was measured.
# The measurements: docs/BENCHMARKS.md, "The opt-in update rule at two ranks (LM and QA)".
UPDATE_RULES = {
    "adam": {"beta": 0.9, "beta2": 0.999, "grad_clip": 1.0},
    "birder": {"beta": 0.95, "beta2": None, "grad_clip": None},
}
BIRDER_PAPER_LR = 5e-4
# "adam": the best rate grew with the workers that vote: 2e-3 of 1e-3 / 2e-3 / 4e-3 at 2 ranks, 4e-3 of 2e-3 / 4e-3 /
# 8e-3 at 4 (seeds 0-2). Beyond 4 voters the rate stays at 4's: at 8 (2 x 4) 8e-3 ended seed 0 at 286.8 against
# 4e-3's 158.1 (docs/results/recipe_matrix_lm_lm2x4_lr_tune.json).
LR_PER_VOTER, MAX_MEASURED_VOTERS = 1e-3, 4
# "adam"'s beta under DDP by the ranks that vote, each chosen on seeds 0-2 and judged on seeds 3-5 (docs/BENCHMARKS.md,
# "The opt-in update rule at two ranks (LM and QA)"). At 2: 0.8 of 0.9 / 0.8 (median perplexity 196.4 against 220.9;
# held out 197.2, worst 199.6; AdamW 188.2 / 228.6). At 4 (2 x 2): 0.85 of 0.9 / 0.85 / 0.8 (148.4 / 151.7 against
# 170.4 / 196.0; 0.8 lost a seed, 235.4; held out 145.7 / 160.2 against 161.5 / 169.7; AdamW 136.1 / 138.9).
# 3 ranks take 2's, more than 4 take 4's; one process and HSDP (not run at these) keep the rule's 0.9.
BETA_BY_VOTERS = {2: 0.8, 4: 0.85}

RECIPE_DEFAULTS = {
    "output_dir": "outputs/causal_lm",
    "max_steps": 150,
    "weight_decay": 0.01,
    "per_device_train_batch_size": 8,
    "per_device_eval_batch_size": 32,
    # 20% of the steps (a float < 1 is a fraction). On the TTA table's LM task (seeds 3-7, which no choice saw)
    # Birder's median final perplexity was 170.0 with 20% and 216.3 with 5%, and 4 of 5 seeds reached the target
    # instead of 3 (docs/results/simulate_quality_lm_seeds3-7_wu0.2.json, _seeds3-7.json). It was 20 of 150 steps.
    "warmup_steps": 0.2,
    "lr_scheduler_type": "cosine",
    "logging_steps": 10,
    "eval_strategy": "steps",
    "eval_steps": 50,
    "save_strategy": "no",
    "report_to": "none",
    "seed": 42,
    "ddp_find_unused_parameters": False,
}


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Pretrained model (Hub name or local path); offline default: --model_config."}
    )
    model_config: str = field(default="tiny", metadata={"help": "Random-init GPT-2 shape: tiny | small | gpt2."})

    def __post_init__(self):
        if self.model_config not in MODEL_CONFIGS:
            raise ValueError(f"--model_config must be one of {sorted(MODEL_CONFIGS)}, got {self.model_config!r}")


@dataclass
class DataArguments:
    block_size: int = field(default=128, metadata={"help": "Tokens per training example."})
    vocab_size: int = field(default=4096, metadata={"help": "BPE vocabulary trained here (no --model_name_or_path)."})
    validation_percent: int = field(default=5, metadata={"help": "Share of the stdlib files held out, by file name."})
    max_eval_blocks: int = field(default=512, metadata={"help": "Validation blocks evaluated (evenly spaced)."})
    max_files: int | None = field(
        default=None, metadata={"help": "Use only the first N files of each split (smoke tests, debugging)."}
    )
    cache_dir: str | None = field(
        default=None, metadata={"help": "Where the tokenizer and token blocks are cached (default: output_dir/data)."}
    )

    def __post_init__(self):
        # checked at parse time, flag by flag: a bad value must not surface after training (an empty validation set
        # failed in evaluate(), before the model was saved) or be read as "no limit" (--max_files 0)
        if self.block_size < 8 or self.vocab_size < 300:
            raise ValueError("--block_size must be >= 8 and --vocab_size >= 300 (the byte alphabet is 256 tokens).")
        if not 0 < self.validation_percent < 100:
            raise ValueError(f"--validation_percent must lie in 1..99, got {self.validation_percent}.")
        if self.max_eval_blocks < 1:
            raise ValueError(f"--max_eval_blocks must be >= 1 (blocks to evaluate), got {self.max_eval_blocks}.")
        if self.max_files is not None and self.max_files < 1:
            raise ValueError(f"--max_files must be >= 1 (or left out: every file), got {self.max_files}.")


@dataclass
class OptimizerArguments(BirderArguments, LocalStepsArguments):
    optimizer: str = field(
        default="birder", metadata={"help": "birder | onebitadam (DDP only) | adamw (the uncompressed baseline)."}
    )

    update_rule: str = field(
        default="adam",
        metadata={"help": "Birder only: adam (Adam's direction, clipped: the default) | birder (the paper's m / b)."},
    )

    # how the default learning rate (and beta) were chosen (logged; not a flag)
    defaults_note: str = field(default="", init=False, repr=False)

    optimizers = ("birder", "onebitadam", "adamw")

    def __post_init__(self):
        super().__post_init__()
        LocalStepsArguments.__post_init__(self)
        check_local_steps(self)
        if self.update_rule not in UPDATE_RULES:
            raise ValueError(f"--update_rule {self.update_rule!r}; choose one of {', '.join(UPDATE_RULES)}.")


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    types = (ModelArguments, DataArguments, OptimizerArguments, TrainingArguments)
    model_args, data_args, opt_args, training_args = parse_recipe_args(types, argv, RECIPE_DEFAULTS)
    if not is_config_file(argv):  # a config file states every setting itself
        apply_rule_defaults(argv, opt_args, training_args)
    return model_args, data_args, opt_args, training_args


def rule_learning_rate(opt_args) -> tuple[float, str]:
    """The default learning rate of Birder's ``--update_rule`` here, and why."""
    if opt_args.update_rule == "birder":
        return BIRDER_PAPER_LR, "the paper's rule's rate on this task"
    n = voters(opt_args)
    used = min(n, MAX_MEASURED_VOTERS)
    note = f"{LR_PER_VOTER:g} per voting worker, {n} voting" + (
        f" (capped at {MAX_MEASURED_VOTERS}, the most measured)" if n > used else ""
    )
    return LR_PER_VOTER * used, note


def apply_rule_defaults(argv: list[str], opt_args, training_args) -> None:
    """Fill the learning rate, Birder's rule settings (see ``UPDATE_RULES``) and the 1-bit local steps' outer step
    the command line left out."""
    given = given_flags(argv)
    if opt_args.local_steps and not given & {"outer_lr", "outer_momentum"} and opt_args.outer_exchange == "onebit":
        # the 1-bit outer exchange's best on this task, of (0.7, 0.5) (LocalSteps' default, QA's best), (0.4, 0.8),
        # (1.0, 0.0) and (0.5, 0.5) on seeds 0-2 at H = 10; on seeds 3-7 and 42 its median perplexity was 3.6% above
        # fp32 DiLoCo's (7.7% with (0.7, 0.5), seeds 3-5; docs/results/recipe_matrix_lm_local_h10_tune.json,
        # recipe_matrix_lm_local_h10_lmtuned_heldout.json, recipe_matrix_lm_local_heldout.json)
        opt_args.outer_lr, opt_args.outer_momentum = 1.0, 0.0
    if opt_args.optimizer != "birder":
        if "learning_rate" not in given:
            training_args.learning_rate = DEFAULT_LR[opt_args.optimizer]
        return
    if opt_args.update_rule == "birder" and given & {"beta2", "grad_clip"}:
        raise ValueError(
            "--update_rule birder votes on m / b without clipping; drop --beta2 / --grad_clip, or use "
            "--update_rule adam."
        )
    for name, value in UPDATE_RULES[opt_args.update_rule].items():
        if name not in given:
            setattr(opt_args, name, value)
    notes = []
    n = voters(opt_args)
    if opt_args.update_rule == "adam" and "beta" not in given and opt_args.sharding == "none" and n >= 2:
        chosen_at = max(k for k in BETA_BY_VOTERS if k <= n)
        opt_args.beta = BETA_BY_VOTERS[chosen_at]
        notes.append(f"beta {opt_args.beta:g}: the rule's at {chosen_at} voting ranks, {n} voting")
    why = "given"
    if "learning_rate" not in given:
        training_args.learning_rate, why = rule_learning_rate(opt_args)
    notes.append(f"learning rate {training_args.learning_rate:g}: {why}")
    opt_args.defaults_note = "; ".join(notes)


def build_data(model_args, data_args, training_args):
    """Tokenizer, train and validation blocks (cached), and the corpus manifest."""
    corpus = stdlib_corpus(data_args.validation_percent)
    if data_args.max_files is not None:
        files = corpus["files"]
        split = {s: [f for f in files if f["split"] == s][: data_args.max_files] for s in ("train", "validation")}
        corpus["files"] = split["train"] + split["validation"]
    tokenizer_name = model_args.model_name_or_path
    key = hashlib.sha256(
        json.dumps([corpus["files"], tokenizer_name, data_args.vocab_size, data_args.block_size]).encode()
    ).hexdigest()[:16]
    folder = os.path.join(data_args.cache_dir or os.path.join(training_args.output_dir, "data"), f"stdlib-{key}")
    with training_args.main_process_first(desc="tokenizing the standard library"):
        if not os.path.isfile(os.path.join(folder, "blocks.pt")):
            os.makedirs(folder, exist_ok=True)
            train_texts = read_split(corpus, "train")
            if tokenizer_name:
                tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
                tokenizer.save_pretrained(folder)
            else:
                tokenizer = train_bpe_tokenizer(train_texts, data_args.vocab_size, out_dir=folder)
            blocks = {
                "train": token_blocks(tokenizer, train_texts, data_args.block_size),
                "validation": token_blocks(tokenizer, read_split(corpus, "validation"), data_args.block_size),
            }
            tmp = os.path.join(folder, f".blocks-{os.getpid()}.pt")
            torch.save(blocks, tmp)
            with open(os.path.join(folder, "data_manifest.json"), "w") as f:
                json.dump({k: v for k, v in corpus.items() if k != "root"}, f, indent=1)
            os.replace(tmp, os.path.join(folder, "blocks.pt"))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    blocks = torch.load(os.path.join(folder, "blocks.pt"), weights_only=True)
    val = blocks["validation"]
    if len(val) > data_args.max_eval_blocks:
        val = val[torch.linspace(0, len(val) - 1, data_args.max_eval_blocks).long()]
    return tokenizer, _dataset(blocks["train"]), _dataset(val), folder


def _dataset(blocks):
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": blocks.tolist(), "labels": blocks.tolist()}).with_format("torch")


def build_model(model_args, data_args, tokenizer):
    if model_args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=data_args.block_size,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **MODEL_CONFIGS[model_args.model_config],
    )
    return GPT2LMHeadModel(config)


class MemoryCounter(TrainerCallback):
    """Bytes this rank holds right after its first optimizer step, counted tensor by tensor: parameters, gradients,
    optimizer state and Birder's communication buffers (deterministic; allocator overhead, activations and DDP's
    gradient buckets are left out)."""

    def __init__(self, trainer):
        self.trainer, self.bytes = trainer, None

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.bytes is not None:
            return
        model, opt = self.trainer.model, unwrap_optimizer(self.trainer.optimizer)

        def size(tensors):
            seen, total = set(), 0
            for t in tensors:
                t = local_tensor(t)
                if t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
            return total

        hook = getattr(self.trainer, "birder_hook_state", None)
        self.bytes = {
            "memory/param_bytes": size(model.parameters()),
            "memory/grad_bytes": size(p.grad for p in model.parameters() if p.grad is not None),
            "memory/optimizer_state_bytes": size(
                v for s in opt.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"
            ),
            "memory/comm_buffer_bytes": hook.buffer_bytes() if hasattr(hook, "buffer_bytes") else 0,
        }


def build_trainer(opt_args, **kwargs):
    if opt_args.optimizer in ("birder", "onebitadam"):
        return BirderTrainer(birder_args=opt_args, **kwargs)
    if opt_args.sharding == "hsdp":
        return HSDPTrainer(num_nodes=opt_args.num_nodes, **kwargs)  # native HSDP: fp32 across the nodes
    if opt_args.local_steps:  # each rank alone for --local_steps steps, then DiLoCo's outer step on a 1-bit exchange
        return LocalStepsTrainer(local_args=opt_args, **kwargs)
    return Trainer(**kwargs)  # AdamW with DDP's fp32 all-reduce


def train(model_args, data_args, opt_args, training_args):
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not training_args.should_log:
        logging.getLogger().setLevel(logging.WARNING)
    check_really_distributed(training_args.world_size)
    if opt_args.optimizer == "onebitadam" and opt_args.sharding == "hsdp":
        raise ValueError("--optimizer onebitadam runs with DDP only; drop --sharding hsdp.")
    logger.info(
        "world size %d, optimizer %s, sharding %s", training_args.world_size, opt_args.optimizer, opt_args.sharding
    )
    if opt_args.optimizer == "birder":
        rule = f"beta {opt_args.beta:g}, beta2 {opt_args.beta2}, grad_clip {opt_args.grad_clip}"
        logger.info("update rule %s (%s); %s", opt_args.update_rule, rule, opt_args.defaults_note)
    tokenizer, train_set, eval_set, data_folder = build_data(model_args, data_args, training_args)
    torch.manual_seed(training_args.seed)
    model = build_model(model_args, data_args, tokenizer)
    trainer = build_trainer(
        opt_args,
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=default_data_collator,
        processing_class=tokenizer,
    )
    memory = MemoryCounter(trainer)
    trainer.add_callback(memory)
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = dict(train_result.metrics)
    metrics.update(trainer.evaluate())
    metrics["eval_perplexity"] = math.exp(metrics["eval_loss"])
    metrics.update(memory.bytes or {})
    metrics.update(
        world_size=training_args.world_size,
        optimizer=opt_args.optimizer,
        sharding=opt_args.sharding,
        num_parameters=sum(p.numel() for p in model.parameters()),
        train_blocks=len(train_set),
        eval_blocks=len(eval_set),
    )
    state = getattr(trainer, "birder_hook_state", None)
    if state is not None:
        metrics.update(state.stats.as_dict("comm/"))
        metrics["comm/topology"] = repr(state.topology)
        metrics["comm/method"] = opt_args.method
    metrics.update(local_steps_metrics(trainer))
    trainer.save_model()  # save_pretrained: config, weights (safetensors), tokenizer
    trainer.save_metrics("all", metrics)  # all_results.json
    trainer.save_state()
    if trainer.is_world_process_zero():
        with open(os.path.join(data_folder, "data_manifest.json")) as f:
            manifest = json.load(f)
        with open(os.path.join(training_args.output_dir, "data_manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
    card = dict(finetuned_from=model_args.model_name_or_path, tasks="text-generation", dataset="Python stdlib source")
    if training_args.push_to_hub:
        trainer.push_to_hub(**card)
    else:
        trainer.create_model_card(**card)
    if trainer.is_world_process_zero():
        _summary(metrics)
    return metrics


def _summary(m):
    line = (
        f"validation perplexity {m['eval_perplexity']:.2f} (loss {m['eval_loss']:.3f}); {m['optimizer']}, "
        f"{m['sharding']}, world size {m['world_size']}"
    )
    if "comm/fp32_allreduce_bytes" in m:
        line += (
            f"\nbytes sent per rank: inter-node {m['comm/inter_node_bytes'] / 1e6:.2f} MB, intra-node "
            f"{m['comm/intra_node_bytes'] / 1e6:.2f} MB, instead of {m['comm/fp32_allreduce_bytes'] / 1e6:.1f} MB for "
            f"an fp32 all-reduce of the same values: {m['comm/compression_ratio']:.1f}x less"
        )
    print(line, flush=True)


def main(argv=None):
    check_elastic_restart()  # torchrun --max-restarts: a restart needs a new store (before the process group)
    return train(*parse_args(argv))


if __name__ == "__main__":
    main()
    release_process_groups()  # every rank's groups released before the interpreter ends (a clean exit status)
