"""Memory per rank and bytes across nodes per step: DDP-Birder vs HSDP-Birder vs HSDP-AdamW (issue 15).

Counts tensor bytes, deterministically (no allocator, no activations): parameters, gradients, optimizer state and the
buffers birder-hf keeps between steps, for one rank of ``k`` nodes x ``L`` ranks:

========================  ==========  ==========  ====================  =====================================
method                    parameters  gradients   optimizer state       communication buffers kept
========================  ==========  ==========  ====================  =====================================
DDP + Birder              4N          4N          8N (m, b)             8N (staged m, b) (+ DDP's 4N buckets)
HSDP + Birder (ours)      4N/L        4N/L        8N/L (m, b)           8N/L (staged m, b) + 4N/L (u)
HSDP + AdamW (native)     4N/L        4N/L        8N/L (exp_avg, _sq)   0
========================  ==========  ==========  ====================  =====================================

(fp32 parameters; a rank's shard is ``ceil(rows / L)`` rows of each parameter, FSDP2's layout). Bytes one rank sends
across nodes per step: HSDP + Birder and DDP + Birder (hierarchical) ``(k-1) N / (8 L)`` (the node's votes of this
rank's shard, all-gathered among the ``k`` replicas), HSDP + AdamW ``2 (k-1)/k x 4 N / L`` (a ring all-reduce of the
fp32 shard among them).

    python benchmarks/memory.py      # docs/results/memory.json + memory.md: the recipe's model (checked against the
                                     # recipe's own counts in docs/results/hsdp_convergence.json), 1B and 7B on 4 x 8

The counts of the recipe's model are exact for rank 0 (the largest shards); ``tests/test_benchmarks.py`` checks them
against what ``recipes/causal_lm.py`` counted in a real run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("ddp-birder", "hsdp-birder", "hsdp-adamw")


def shard_numel(shapes: list[tuple[int, ...]], ranks_per_node: int) -> int:
    """Elements of rank 0's shards: ``ceil(rows / L)`` rows of every parameter (FSDP2's ``Shard(0)``)."""
    total = 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        rest = 1
        for s in shape[1:]:
            rest *= s
        total += -(-rows // ranks_per_node) * rest
    return total


def per_rank_bytes(method: str, shapes: list[tuple[int, ...]], ranks_per_node: int) -> dict[str, int]:
    """Bytes rank 0 holds (fp32 parameters), by kind; ``shapes``: every parameter's shape."""
    if method not in METHODS:
        raise ValueError(f"method {method!r}; choose one of {METHODS}")
    sharded = method.startswith("hsdp")
    n = shard_numel(shapes, ranks_per_node) if sharded else shard_numel(shapes, 1)
    out = {"param_bytes": 4 * n, "grad_bytes": 4 * n, "optimizer_state_bytes": 8 * n, "comm_buffer_bytes": 0}
    if method.endswith("birder"):
        out["comm_buffer_bytes"] = 8 * n + (4 * n if sharded else 0)  # staged m, b (+ u of the shard)
    out["total_bytes"] = sum(out.values())
    return out


def inter_node_bytes(method: str, numel: int, nodes: int, ranks_per_node: int) -> float:
    """Bytes one rank sends across nodes per step."""
    k, lws = nodes, ranks_per_node
    if method in ("hsdp-birder", "ddp-birder"):
        return (k - 1) * numel / (8 * lws)  # the 1-bit votes of a 1/L share, all-gathered among the k nodes
    return 2 * (k - 1) / k * 4 * numel / lws  # hsdp-adamw: a ring all-reduce of the fp32 shard among the k replicas


def gpt2_shapes(**config) -> list[tuple[int, ...]]:
    """Parameter shapes of ``GPT2LMHeadModel(GPT2Config(**config))`` (on the meta device; the tied LM head once)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0, **config))
    return [tuple(p.shape) for p in model.parameters()]


def table(rows: list[dict], unit: str) -> str:
    """A markdown table of ``rows`` in ``unit`` ("MB" = 1e6 bytes or "GB" = 1e9 bytes), numbers as stored in JSON."""
    lines = [
        f"| model | nodes x ranks | method | parameters ({unit}) | gradients ({unit}) | optimizer state ({unit}) | "
        f"comm buffers ({unit}) | total per rank ({unit}) | sent across nodes per step per rank ({unit}) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v = r[unit]
        lines.append(
            f"| {r['model']} | {r['nodes']} x {r['ranks_per_node']} | {r['method']} | {v['param_bytes']} | "
            f"{v['grad_bytes']} | {v['optimizer_state_bytes']} | {v['comm_buffer_bytes']} | {v['total_bytes']} | "
            f"{v['inter_node_bytes']} |"
        )
    return "\n".join(lines) + "\n"


def build(recipe_config: dict, recipe_layout: tuple[int, int], big_layout: tuple[int, int]) -> dict:
    rows = []
    models = [("recipe (tiny GPT-2)", gpt2_shapes(**recipe_config), recipe_layout)]
    # 1B / 7B: N parameters as rows of 1000 (a multiple of 8 rows: every rank's shard is exactly N/L)
    models += [(name, [(numel // 1000, 1000)], big_layout) for name, numel in (("1B", 10**9), ("7B", 7 * 10**9))]
    for name, shapes, (k, lws) in models:
        numel = shard_numel(shapes, 1)
        for method in METHODS:
            sizes = {
                **per_rank_bytes(method, shapes, lws),
                "inter_node_bytes": inter_node_bytes(method, numel, k, lws),
            }
            rows.append(
                {
                    "model": name,
                    "numel": numel,
                    "nodes": k,
                    "ranks_per_node": lws,
                    "method": method,
                    "bytes": sizes,
                    "MB": {key: round(v / 1e6, 3) for key, v in sizes.items()},
                    "GB": {key: round(v / 1e9, 3) for key, v in sizes.items()},
                }
            )
    return {"recipe_config": recipe_config, "rows": rows}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results_dir", type=Path, default=ROOT / "docs" / "results")
    args = p.parse_args(argv)
    # recipes/causal_lm.py's default: MODEL_CONFIGS["tiny"], --vocab_size 4096, --block_size 128, 2 nodes x 2
    recipe = dict(n_embd=128, n_layer=4, n_head=4, vocab_size=4096, n_positions=128)
    result = {**build(recipe, (2, 2), (4, 8)), **provenance(__file__, argv)}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "memory.json").write_text(json.dumps(result, indent=1) + "\n")
    small = [r for r in result["rows"] if r["model"].startswith("recipe")]
    text = table(small, "MB") + "\n" + table([r for r in result["rows"] if r not in small], "GB")
    (args.results_dir / "memory.md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
