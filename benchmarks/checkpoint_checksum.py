"""What the completion marker's SHA-256 costs on a BERT-Base checkpoint (issue 41).

    python benchmarks/checkpoint_checksum.py     # docs/results/checkpoint_checksum.json

Builds BERT-Base for question answering (``BertConfig()``: 108.9M parameters, random weights: the bytes are what
count), gives Birder a state (one step), and times, side by side in one process, ``--repeats`` times each (median):

- ``save``: what a checkpoint costs without the marker, ``model.save_pretrained`` (safetensors) plus
  :func:`~birder_hf.checkpoint.save_rank_state` (Birder's ``m`` and ``b``, fsynced);
- ``mark``: :func:`~birder_hf.elastic.mark_checkpoint_complete`, which now hashes every file, against the sizes
  alone (the marker before the checksum);
- ``discover``: :func:`~birder_hf.elastic.checkpoint_problem`, what ``--resume_from_checkpoint auto`` runs on the
  checkpoint it resumes from (it reads every listed file once), and ``read``: :func:`read_rank_state`, which hashes
  the rank's own file before loading it.

One rank (world size 1). With R ranks on a shared disk each rank hashes its own state file in parallel and rank 0
hashes the rest, so ``mark`` grows by the model's hash only; ``discover`` runs on rank 0 alone and reads R state
files. The files are in the page cache when hashed (just written or read), as they are in a real save and resume.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "checkpoint_checksum.json"))
    args = parser.parse_args(argv)

    from transformers import BertConfig, BertForQuestionAnswering

    from birder_hf import Birder
    from birder_hf.checkpoint import file_sha256, read_rank_state, save_rank_state
    from birder_hf.elastic import _checkpoint_files, checkpoint_problem, mark_checkpoint_complete

    torch.manual_seed(0)
    model = BertForQuestionAnswering(BertConfig())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = Birder(params, lr=1e-4)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()

    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "checkpoint-1")

        def save():
            model.save_pretrained(folder)
            save_rank_state(opt, folder, rank=0, world_size=1)

        def sizes_only():  # the marker's work before it recorded digests
            return {rel: os.path.getsize(full) for rel, full in _checkpoint_files(folder).items()}

        t_save = _median_seconds(save, args.repeats)
        t_sizes = _median_seconds(sizes_only, args.repeats)
        t_mark = _median_seconds(lambda: mark_checkpoint_complete(folder, rank=0, world_size=1), args.repeats)
        t_discover = _median_seconds(lambda: checkpoint_problem(folder), args.repeats)
        state = os.path.join(folder, "birder", "rank_00000-of-00001.pt")
        t_hash_state = _median_seconds(lambda: file_sha256(state), args.repeats)
        t_read = _median_seconds(lambda: read_rank_state(folder, rank=0, world_size=1), args.repeats)
        files = {rel: os.path.getsize(full) for rel, full in _checkpoint_files(folder).items()}
        assert checkpoint_problem(folder) is None

    total = sum(files.values())
    result = {
        **provenance(__file__, argv),
        "model": "BertForQuestionAnswering(BertConfig()), BERT-Base",
        "parameters": sum(p.numel() for p in params),
        "files_bytes": files,
        "checkpoint_bytes": total,
        "repeats": args.repeats,
        "seconds": {
            "save (save_pretrained + save_rank_state)": round(t_save, 3),
            "mark, sizes only (before)": round(t_sizes, 4),
            "mark, sizes + sha256 (now)": round(t_mark, 3),
            "discover (checkpoint_problem, now)": round(t_discover, 3),
            "sha256 of the rank state alone": round(t_hash_state, 3),
            "read_rank_state (its hash included)": round(t_read, 3),
        },
        "sha256_MB_per_s": round(total / 1e6 / t_discover, 1),
        "mark_over_save": round(t_mark / t_save, 3),
        "state_hash_share_of_read": round(t_hash_state / t_read, 3),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_1min": os.getloadavg()[0],
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
