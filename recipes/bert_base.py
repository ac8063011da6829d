# /// script
# requires-python = ">=3.10"
# dependencies = ["birder-hf[recipes]"]
# ///
"""Fine-tune BERT for extractive question answering (SQuAD 1.1) with Birder, through the HF Trainer.

The paper's BERT-Base workload, as HF users run it. Offline by default: with no arguments it trains a
tiny BERT from scratch on an embedded SQuAD-format task the project generates (written to JSON and read
through the same path real SQuAD files take) and reports SQuAD exact match / F1.

    # CPU, one machine, 4 processes as 2 simulated nodes x 2 (hierarchical 1-bit all-reduce):
    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/cpu.yaml recipes/bert_base.py --num_nodes 2
    # GPUs, 4 nodes x 8 (run on every node with its --machine_rank), real SQuAD and BERT-Base:
    accelerate launch --config_file accelerate_configs/multi_node_4x8.yaml --machine_rank $NODE_RANK \\
        --main_process_ip $MASTER recipes/bert_base.py --model_name_or_path bert-base-uncased \\
        --dataset_name squad --max_seq_length 384 --doc_stride 128 --learning_rate 5e-5 --num_train_epochs 2 \\
        --per_device_train_batch_size 12 --bf16 --output_dir outputs/bert_base_squad

Any `TrainingArguments` flag works (--max_steps, --save_steps, --resume_from_checkpoint, --seed, --report_to,
--push_to_hub, ...). A single .json or .yaml argument is read as the whole configuration. Under
`torchrun --max-restarts N`, `--resume_from_checkpoint auto` resumes from the newest checkpoint complete on every rank
(docs/SETUPS.md, "Fault tolerance").
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import (
    AutoModelForQuestionAnswering,
    AutoTokenizer,
    BertConfig,
    BertForQuestionAnswering,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from embedded_data import build_wordpiece_tokenizer, load_squad_json, make_squad_dataset  # noqa: E402
from qa_utils import (  # noqa: E402
    postprocess_qa_predictions,
    prepare_eval_features,
    prepare_train_features,
    squad_metrics,
)
from recipe_args import (  # noqa: E402
    check_local_steps,
    given_flags,
    is_config_file,
    local_steps_metrics,
    parse_recipe_args,
    voters,
)

from birder_hf.integrations.accelerate import check_elastic_restart, check_really_distributed  # noqa: E402
from birder_hf.integrations.transformers import (  # noqa: E402
    BirderArguments,
    BirderTrainer,
    LocalStepsArguments,
    LocalStepsTrainer,
)
from birder_hf.lifecycle import release_process_groups  # noqa: E402

logger = logging.getLogger("bert_base")

MODEL_CONFIGS = {
    # BERT-Base (110M parameters), random init: the paper's model without the Hub
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    # small enough to learn the embedded task in a few CPU minutes; a wider init and no dropout let it learn the
    # answer types within ~300 steps (BERT's defaults need ~2x the steps: recipes/embedded_data.py measurements)
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=512,
        initializer_range=0.08,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
}

# Recipe defaults that differ from TrainingArguments' (which suit fine-tuning a pretrained model on GPUs);
# any of them given on the command line wins.
RECIPE_DEFAULTS = {
    "output_dir": "outputs/bert_base_qa",
    "max_steps": 300,
    "learning_rate": 2e-3,
    "weight_decay": 0.01,
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 64,
    # A float < 1 is a fraction of the steps. 20%: on the QA task Birder's worst of 11 unseen seeds ended at F1 51.7
    # with it and 35.9 with 5% (docs/BENCHMARKS.md, "A longer warm-up"; docs/results/seed_sweep_qa.json).
    "warmup_steps": 0.2,
    "lr_scheduler_type": "linear",
    "logging_steps": 25,
    "save_strategy": "no",  # --save_steps N alone switches it to "steps"
    "report_to": "none",
    "seed": 42,
    "ddp_find_unused_parameters": False,
}

# Birder's beta and stale mode, where the command line gives none: chosen for the number of workers that vote
# (every rank under DDP, every node under --sharding hsdp), at each measured count by the median F1 of seeds 0-2:
# beta the best of 0.95 (the paper's), 0.9, 0.8 (and 0.7 at 2), then the stale mode the better of fade and keep.
# Fewer than 2 voters take 2's, more than 4 take 4's: nothing else was measured. A smaller beta gives each rank a
# larger |u| = |m| / b, so its 1-bit vote carries less noise, (1 - u^2) per coordinate, and a shorter memory of the
# gradient; the fewer the voters, the more the first matters. docs/BENCHMARKS.md, "The BERT recipe's beta at two and
# four ranks (QA)".
RULE_BY_VOTERS = {2: {"beta": 0.8, "stale": "keep"}, 4: {"beta": 0.9, "stale": "fade"}}


def voter_rule(opt_args) -> tuple[dict, int, int]:
    """Birder's default settings here for the workers that vote: the rule, the count it was chosen at, the voters."""
    n = voters(opt_args)
    chosen_at = max((k for k in RULE_BY_VOTERS if k <= n), default=min(RULE_BY_VOTERS))
    return RULE_BY_VOTERS[chosen_at], chosen_at, n


@dataclass
class ModelArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Pretrained model (Hub name or local path); offline default: --model_config."}
    )
    model_config: str = field(default="tiny", metadata={"help": "Random-init size when no model is given: base|tiny."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model's, or built)."})

    def __post_init__(self):
        if self.model_config not in MODEL_CONFIGS:
            raise ValueError(f"--model_config must be one of {sorted(MODEL_CONFIGS)}, got {self.model_config!r}")


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset in SQuAD format, e.g. squad."})
    train_file: str | None = field(default=None, metadata={"help": "SQuAD v1.1-format JSON for training."})
    validation_file: str | None = field(default=None, metadata={"help": "SQuAD v1.1-format JSON for evaluation."})
    embedded_num_train: int = field(default=2400, metadata={"help": "Questions in the embedded train set."})
    embedded_num_eval: int = field(default=240, metadata={"help": "Questions in the embedded eval set."})
    max_seq_length: int = field(default=128, metadata={"help": "Tokens per window (SQuAD with BERT: 384)."})
    doc_stride: int = field(default=64, metadata={"help": "Overlap between windows of long contexts."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the train set (debugging)."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the eval set (debugging)."})
    n_best_size: int = field(default=20, metadata={"help": "Start/end candidates per window when decoding."})
    max_answer_length: int = field(default=30, metadata={"help": "Longest answer in tokens."})

    def __post_init__(self):
        if self.dataset_name and (self.train_file or self.validation_file):
            raise ValueError("Give --dataset_name or --train_file/--validation_file, not both.")
        if bool(self.train_file) != bool(self.validation_file):
            raise ValueError("--train_file and --validation_file go together.")
        for flag, path in (("--train_file", self.train_file), ("--validation_file", self.validation_file)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{flag} {path} is not a file (SQuAD v1.1-format JSON).")
        if self.doc_stride >= self.max_seq_length:
            raise ValueError("--doc_stride must be smaller than --max_seq_length.")
        # every count is checked here, flag by flag (--max_train_samples 0 used to mean "all of them")
        for flag, value, low in (
            ("--embedded_num_train", self.embedded_num_train, 1),
            ("--embedded_num_eval", self.embedded_num_eval, 1),
            ("--max_seq_length", self.max_seq_length, 1),
            ("--doc_stride", self.doc_stride, 0),
            ("--n_best_size", self.n_best_size, 1),
            ("--max_answer_length", self.max_answer_length, 1),
        ):
            if value < low:
                raise ValueError(f"{flag} must be >= {low}, got {value}.")
        for flag, value in (
            ("--max_train_samples", self.max_train_samples),
            ("--max_eval_samples", self.max_eval_samples),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1 (or left out: every example), got {value}.")


@dataclass
class OptimizerArguments(BirderArguments, LocalStepsArguments):
    optimizer: str = field(
        default="birder",
        metadata={
            "help": "birder | onebitadam (1-bit Adam after --freeze_step Adam steps) | adamw | sgdm (uncompressed)."
        },
    )
    hierarchy: bool = field(
        default=False, metadata={"help": "The official code's --hierarchy: same as --method hierarchical."}
    )
    momentum: float = field(default=0.9, metadata={"help": "sgdm only."})

    # how the voter rule's settings were chosen (logged; not a flag)
    rule_note: str = field(default="", init=False, repr=False)

    optimizers = ("birder", "onebitadam", "adamw", "sgdm")

    def __post_init__(self):
        super().__post_init__()
        LocalStepsArguments.__post_init__(self)
        check_local_steps(self)
        if self.hierarchy:
            self.method = "hierarchical"


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    types = (ModelArguments, DataArguments, OptimizerArguments, TrainingArguments)
    model_args, data_args, opt_args, training_args = parse_recipe_args(types, argv, RECIPE_DEFAULTS)
    apply_voter_rule(argv, opt_args)
    return model_args, data_args, opt_args, training_args


def apply_voter_rule(argv: list[str], opt_args) -> None:
    """Birder's settings from ``RULE_BY_VOTERS``, each unless the command line gives it, and the note the run logs.
    A config file states every setting itself (where it names none, ``BirderArguments``' defaults apply), as in
    ``causal_lm.py``."""
    if opt_args.optimizer != "birder" or is_config_file(argv):
        return
    given = given_flags(argv)
    rule, chosen_at, n = voter_rule(opt_args)
    applied = {name: value for name, value in rule.items() if name not in given}
    for name, value in applied.items():
        setattr(opt_args, name, value)
    if applied:
        shown = ", ".join(
            f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}" for name, value in applied.items()
        )
        opt_args.rule_note = f"{shown}: chosen at {chosen_at} voting workers, {n} voting"


def build_datasets(data_args, training_args):
    """Raw train/eval datasets in the HF ``squad`` columns: Hub, local SQuAD JSON, or the embedded task."""
    if data_args.dataset_name:
        from datasets import load_dataset

        raw = load_dataset(data_args.dataset_name)
        return raw["train"], raw["validation"]
    train_file, eval_file = data_args.train_file, data_args.validation_file
    if not train_file:
        folder = os.path.join(training_args.output_dir, "embedded_squad")
        with training_args.main_process_first(desc="writing the embedded SQuAD-format data"):
            train_file, eval_file = make_squad_dataset(
                folder, data_args.embedded_num_train, data_args.embedded_num_eval, seed=0
            )
    return load_squad_json(train_file), load_squad_json(eval_file)


def build_tokenizer(model_args, train_raw, training_args):
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name:
        return AutoTokenizer.from_pretrained(name)
    ckpt = training_args.resume_from_checkpoint
    if ckpt and os.path.isfile(os.path.join(ckpt, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(ckpt)  # the ids the checkpoint was trained with
    folder = os.path.join(training_args.output_dir, "embedded_tokenizer")
    with training_args.main_process_first(desc="training the WordPiece tokenizer"):
        if training_args.process_index == 0 or not os.path.isdir(folder):
            contexts = sorted(set(train_raw["context"]))
            return build_wordpiece_tokenizer(contexts + list(train_raw["question"]), out_dir=folder)
    return AutoTokenizer.from_pretrained(folder)


def build_model(model_args, tokenizer):
    if model_args.model_name_or_path:
        return AutoModelForQuestionAnswering.from_pretrained(model_args.model_name_or_path)
    config = BertConfig(vocab_size=len(tokenizer), **MODEL_CONFIGS[model_args.model_config])
    return BertForQuestionAnswering(config)


def build_trainer(opt_args, **kwargs):
    args = kwargs["args"]
    if opt_args.optimizer in ("birder", "onebitadam"):
        return BirderTrainer(birder_args=opt_args, **kwargs)  # the optimizer, its 1-bit hook, per-rank state
    if opt_args.optimizer == "sgdm":
        sgd = dict(lr=args.learning_rate, momentum=opt_args.momentum, weight_decay=args.weight_decay)
        kwargs["optimizer_cls_and_kwargs"] = (torch.optim.SGD, sgd)
    if opt_args.local_steps:  # each rank alone for --local_steps steps, then DiLoCo's outer step on a 1-bit exchange
        return LocalStepsTrainer(local_args=opt_args, **kwargs)
    return Trainer(**kwargs)  # AdamW with fp32 all-reduce: the uncompressed baseline


def evaluate_squad(trainer, eval_raw, eval_features, data_args):
    model_inputs = eval_features.remove_columns(["example_id", "offset_mapping"])
    output = trainer.predict(model_inputs)
    start_logits, end_logits = output.predictions[:2] if isinstance(output.predictions, tuple) else output.predictions
    predictions = postprocess_qa_predictions(
        eval_raw, eval_features, start_logits, end_logits, data_args.n_best_size, data_args.max_answer_length
    )
    return {f"eval_{k}": v for k, v in squad_metrics(predictions, eval_raw).items()}, predictions


def train(model_args, data_args, opt_args, training_args):
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if not training_args.should_log:
        logging.getLogger().setLevel(logging.WARNING)
    check_really_distributed(training_args.world_size)  # the accelerate --multi_gpu-on-CPU trap
    logger.info("world size %d, optimizer %s (%s)", training_args.world_size, opt_args.optimizer, opt_args.method)
    if opt_args.optimizer == "birder":
        logger.info("%s", opt_args.rule_note or f"beta {opt_args.beta:g}, stale {opt_args.stale}: given")

    train_raw, eval_raw = build_datasets(data_args, training_args)
    if data_args.max_train_samples is not None:
        train_raw = train_raw.select(range(min(data_args.max_train_samples, len(train_raw))))
    if data_args.max_eval_samples is not None:
        eval_raw = eval_raw.select(range(min(data_args.max_eval_samples, len(eval_raw))))
    tokenizer = build_tokenizer(model_args, train_raw, training_args)
    torch.manual_seed(training_args.seed)
    model = build_model(model_args, tokenizer)

    window = dict(tokenizer=tokenizer, max_seq_length=data_args.max_seq_length, doc_stride=data_args.doc_stride)
    with training_args.main_process_first(desc="tokenizing"):
        train_features = train_raw.map(
            prepare_train_features, batched=True, remove_columns=train_raw.column_names, fn_kwargs=window
        )
        eval_features = eval_raw.map(
            prepare_eval_features, batched=True, remove_columns=eval_raw.column_names, fn_kwargs=window
        )

    trainer = build_trainer(
        opt_args,
        model=model,
        args=training_args,
        train_dataset=train_features,
        data_collator=default_data_collator,
        processing_class=tokenizer,
    )
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = dict(train_result.metrics)
    eval_metrics, predictions = evaluate_squad(trainer, eval_raw, eval_features, data_args)
    metrics.update(eval_metrics)

    state = getattr(trainer, "birder_hook_state", None)
    metrics.update(world_size=training_args.world_size, optimizer=opt_args.optimizer)
    if state is not None:  # Birder: what the 1-bit hook saved
        metrics.update({k: v for k, v in state.stats.as_dict("comm/").items()})
        metrics["comm/topology"] = repr(state.topology)
        metrics["comm/method"] = opt_args.method if opt_args.optimizer == "birder" else opt_args.optimizer
    metrics.update(local_steps_metrics(trainer))
    trainer.save_model()  # save_pretrained: config, weights (safetensors), tokenizer
    trainer.save_metrics("all", metrics)  # all_results.json
    trainer.save_state()
    if trainer.is_world_process_zero():
        with open(os.path.join(training_args.output_dir, "eval_predictions.json"), "w") as f:
            json.dump(predictions, f, indent=1)
    kwargs = dict(
        finetuned_from=model_args.model_name_or_path,  # None: trained from scratch
        tasks="question-answering",
        dataset=data_args.dataset_name or "embedded synthetic SQuAD",
    )
    if isinstance(trainer, BirderTrainer):  # Birder: EM/F1 into the card's model-index
        kwargs["metrics"] = {"exact_match": metrics["eval_exact_match"], "f1": metrics["eval_f1"]}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)
    if trainer.is_world_process_zero():
        _summary(metrics)
    return metrics


def _summary(m):
    line = f"EM {m['eval_exact_match']:.1f}  F1 {m['eval_f1']:.1f}  ({m['optimizer']}, world size {m['world_size']})"
    if "comm/fp32_allreduce_bytes" in m:
        sent = m["comm/intra_node_bytes"] + m["comm/inter_node_bytes"]
        line += (
            f"\nbytes sent per rank: {sent / 1e6:.2f} MB (inter-node {m['comm/inter_node_bytes'] / 1e6:.2f} MB) "
            f"instead of {m['comm/fp32_allreduce_bytes'] / 1e6:.1f} MB for fp32 all-reduce: "
            f"{m['comm/compression_ratio']:.1f}x less"
        )
    print(line, flush=True)


def main(argv=None):
    check_elastic_restart()  # torchrun --max-restarts: a restart needs a new store (before the process group)
    return train(*parse_args(argv))


if __name__ == "__main__":
    main()
    release_process_groups()  # every rank's groups released before the interpreter ends (a clean exit status)
