"""The causal-LM recipe's offline data: the standard library's sources, a fixed split, a deterministic tokenizer."""

import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))

from stdlib_text import EOS, read_split, stdlib_corpus, token_blocks, train_bpe_tokenizer  # noqa: E402

_TRAIN_SMALL = """
import hashlib, json, sys
sys.path.insert(0, {recipes!r})
from stdlib_text import read_split, stdlib_corpus, train_bpe_tokenizer
corpus = stdlib_corpus(5)
corpus["files"] = [f for f in corpus["files"] if f["split"] == "train"][:40]
tok = train_bpe_tokenizer(read_split(corpus, "train"), 600)
print(hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest())
"""


def test_the_split_is_fixed_by_file_name_and_leaves_tests_out():
    corpus = stdlib_corpus(5)
    files = corpus["files"]
    assert corpus["python"] == sys.version.split()[0]
    assert not any("/test/" in f["path"] or f["path"].startswith(("test/", "site-packages/")) for f in files)
    assert all(len(f["sha256"]) == 64 and f["bytes"] >= 0 for f in files)
    val = [f for f in files if f["split"] == "validation"]
    assert 0.02 < len(val) / len(files) < 0.1  # about 5 % of the files, chosen by the hash of their path
    bucket = {f["path"]: int(hashlib.sha256(f["path"].encode()).hexdigest()[:8], 16) % 100 for f in files}
    assert all((bucket[f["path"]] < 5) == (f["split"] == "validation") for f in files)
    assert stdlib_corpus(5) == corpus  # a second listing gives the same manifest
    assert json.loads(json.dumps(corpus)) == corpus  # the manifest is plain JSON


def test_tokenizer_training_is_deterministic_across_processes():
    code = _TRAIN_SMALL.format(recipes=os.path.join(ROOT, "recipes"))
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
        for _ in range(2)
    ]
    hashes = {r.stdout.strip().splitlines()[-1] for r in runs}
    assert len(hashes) == 1, hashes


def test_token_blocks_round_trip(tmp_path):
    corpus = stdlib_corpus(5)
    corpus["files"] = [f for f in corpus["files"] if f["split"] == "validation"][:3]
    texts = read_split(corpus, "validation")
    tok = train_bpe_tokenizer(texts, 400, out_dir=str(tmp_path))
    blocks = token_blocks(tok, texts, 32)
    assert blocks.shape[1] == 32 and blocks.dtype.is_floating_point is False
    ids = blocks.reshape(-1).tolist()
    assert tok.convert_tokens_to_ids(EOS) == tok.eos_token_id and tok.eos_token_id in ids  # files are separated
    # byte-level BPE loses nothing: the first text comes back exactly
    first = ids[: ids.index(tok.eos_token_id)]
    assert tok.decode(first) == texts[0][: len(tok.decode(first))] and len(tok.decode(first)) == len(texts[0])
