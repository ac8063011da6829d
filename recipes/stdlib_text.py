"""Offline text for the causal-LM recipe: the Python standard library's own source files.

Every Python ships the source of its standard library (``sysconfig.get_paths()["stdlib"]``): about 12 MB of real,
varied text (code, docstrings, comments) in 700+ ``.py`` files, tests and ``site-packages`` left out. It differs
between Python versions, so the manifest records the version and every file's SHA-256.

- `stdlib_corpus` lists the files with a fixed train/validation split: a file is in validation when the hash of
  its relative path falls in the first ``validation_percent`` of 100 buckets (the split follows the name, so it
  stays put when a file's content changes between versions).
- `train_bpe_tokenizer` trains a byte-level BPE tokenizer (GPT-2's scheme) with ``tokenizers``; training is
  deterministic (two processes give the same vocabulary, ``tests/test_causal_lm_data.py``).
- `token_blocks` concatenates the tokenized files of a split (an end-of-text token between files) and cuts them
  into blocks of ``block_size`` tokens.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig

__all__ = ["stdlib_corpus", "train_bpe_tokenizer", "token_blocks", "EOS"]

EOS = "<|endoftext|>"
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_corpus(validation_percent: int = 5, root: str | None = None) -> dict:
    """The standard library's ``.py`` files (tests and site-packages excluded) split into train/validation.

    Returns ``{"python": version, "root": folder, "files": [{"path", "sha256", "bytes", "split"}, ...]}``, files
    sorted by relative path.
    """
    if not 0 < validation_percent < 100:
        raise ValueError(f"validation_percent={validation_percent} must lie in (0, 100)")
    root = root or sysconfig.get_paths()["stdlib"]
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            with open(path, "rb") as f:
                data = f.read()
            bucket = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100
            split = "validation" if bucket < validation_percent else "train"
            files.append({"path": rel, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "split": split})
    files.sort(key=lambda f: f["path"])
    if not any(f["split"] == "validation" for f in files) or not any(f["split"] == "train" for f in files):
        raise RuntimeError(f"{root} holds too few .py files ({len(files)}) for a train/validation split")
    return {"python": sys.version.split()[0], "root": root, "files": files}


def read_split(corpus: dict, split: str) -> list[str]:
    """The texts of one split, in manifest order (undecodable bytes replaced)."""
    out = []
    for f in corpus["files"]:
        if f["split"] == split:
            with open(os.path.join(corpus["root"], f["path"]), encoding="utf-8", errors="replace") as fh:
                out.append(fh.read())
    return out


def train_bpe_tokenizer(texts: list[str], vocab_size: int, out_dir: str | None = None):
    """A byte-level BPE tokenizer trained on ``texts``, as a transformers fast tokenizer (saved to ``out_dir``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=EOS)
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast


def token_blocks(tokenizer, texts: list[str], block_size: int):
    """``(n, block_size)`` int64 blocks of the concatenated token ids (EOS between texts; the remainder dropped)."""
    import torch

    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // block_size
    if n == 0:
        raise ValueError(f"{len(ids)} tokens do not fill one block of {block_size}")
    return torch.tensor(ids[: n * block_size], dtype=torch.int64).view(n, block_size)
