"""Alpha-beta cost model: predicted speedup of Birder over fp32 DDP on 1-8 nodes x 8 A100, 10 GbE and 100 Gbit IB.

    python benchmarks/cost_model.py                    # docs/results/cost_model.json + cost_model.png
    python benchmarks/cost_model.py --precision amp    # sensitivity: mixed-precision compute (faster GPUs)

Per step and GPU: ``step = compute + codec + max(0, comm - overlap * backward)``, with backward = 2/3 of compute
(DDP overlaps bucket communication with the rest of backward) and the codec serialized with compute (the hook
runs its kernels on the compute stream). Every collective costs ``messages x alpha + bytes / bandwidth`` on its
bottleneck link: the node's one NIC for inter-node traffic (shared by the node's 8 GPUs), NVLink inside a node.

=====================  =======================================================  ===============================
method                 bytes on the bottleneck link (d parameters, k nodes of L)  messages (latency) per bucket
=====================  =======================================================  ===============================
fp32 ring all-reduce   NIC: 2(n-1)/n x 4d  (k = 1: NVLink)                        2(n-1)
fp16 hook              NIC: 2(n-1)/n x 2d                                         2(n-1)
Birder allgather       NIC: (n-1) x d/8 (ring all-gather of the packed bits)      n-1
Birder scatter_gather  NIC: L(n-L)/n x d/8 (all-to-all) + (n-1)/n x d/8           2(n-1)
Birder hierarchical    NIC: (k-1) x d/8; NVLink: (L-1)/L x d/8 x (1 + bits(k))    (k-1) + 2(L-1)
 (inter scatter_gather) NIC: 2(k-1)/k x d/8                                       2(k-1) + 2(L-1)
=====================  =======================================================  ===============================

plus, for Birder, one tiny finite-flag all-reduce per step (tree: 2 log2(n) x alpha). Compute times come from
published A100 throughput (cited in ``ASSUMPTIONS``). The codec's cost, in fp32 copies of the gradient, comes from
``docs/results/gpu.json`` when a GPU measured it (``benchmarks/device_check.py``: Birder's step minus AdamW's with
DDP on one rank, in units of a ``copy_`` timed in the same run), else from this repository's CPU measurements
(``docs/results/throughput.json``: the hook's extra time in a no-communication run, or ``codec.json``'s kernel
ratios); either is converted to an A100 by its memory bandwidth (the codec is a few streaming passes over the
gradient). The output says which source it used (``calibration.source``). With ``docs/results/throughput.json``
present, the model is also checked against the testbed: the same formulas with the testbed's link and measured CPU
compute predict the measured ethernet ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # benchmarks/provenance.py
from provenance import provenance  # noqa: E402

NUMEL = {"bert": 108_893_186, "resnet50": 25_557_032}  # BertForQuestionAnswering(BertConfig()), timm resnet50
# A100 80GB (DGX A100), one GPU, samples/s. ResNet-50 v1.5: NVIDIA DeepLearningExamples, PyTorch, pytorch-21.03
# container: TF32 938 img/s, AMP 2470 img/s. BERT-Base seq 128 has no published A100 training number there; we scale
# BERT-Large phase-1 (seq 128) pre-training, DeepLearningExamples PaddlePaddle/LanguageModeling/BERT (TF32 307,
# AMP 694 seq/s) by the training-FLOP ratio at seq 128: (6 x 302M x 128 + attention) / (6 x 85M x 128 + attention)
# = 237 / 67 GFLOP = 3.53 (non-embedding parameters; both 128-token sequences).
A100_SAMPLES_PER_S = {
    "tf32": {"resnet50": 938.0, "bert": 307.0 * 3.53},
    "amp": {"resnet50": 2470.0, "bert": 694.0 * 3.53},
}
NETWORKS = {
    "10GbE": {"label": "10 Gbit/s Ethernet", "gbit": 10.0, "efficiency": 0.94, "alpha_s": 50e-6},
    "100G-IB": {"label": "100 Gbit/s InfiniBand", "gbit": 100.0, "efficiency": 0.95, "alpha_s": 5e-6},
}
ASSUMPTIONS = {
    "gpus_per_node": 8,
    "nodes": [1, 2, 4, 8],
    "batches_per_gpu": [32, 128],
    "nvlink_GBps": 200.0,  # per-GPU bus bandwidth inside a node (NCCL all-reduce busbw on A100 NVLink3 is ~230)
    "nvlink_alpha_s": 5e-6,
    "bucket_MiB": 25,  # DDP's default bucket_cap_mb: one collective per bucket, latency paid per bucket
    "backward_fraction": 2 / 3,  # of compute: the part communication can overlap with
    "overlap": 0.8,  # fraction of backward that hides communication (the last bucket never overlaps)
    "codec_overlap": 0.0,  # the hook's kernels run on the compute stream: not hidden
    "gpu_hbm_GBps": 1555.0,  # A100 40GB HBM2; 80GB: 2039 (faster codec)
    "gpu_hbm_efficiency": 0.8,  # achieved streaming bandwidth / peak
    "ethernet_efficiency_note": "TCP goodput / line rate (this testbed measured 144.8/150 = 0.965)",
    "one_nic_per_node": True,
}
PAPER = {
    "network": "10GbE",
    "bert": 6.3,
    "resnet50": 2.5,
    "nodes": 8,
    "note": "up to, over SGDM/Adam, 1-8 nodes x 8 A100",
}
METHODS = (
    "fp32",
    "fp16",
    "birder-allgather",
    "birder-scatter_gather",
    "birder-hierarchical",
    "birder-hierarchical-sg",
)
# codec cost in copy-equivalents (one copy_ of fp32 = 8 bytes of memory traffic per element) when the hook, the
# quantizer, the decode and Birder's update each stream once: encode reads g, m, b and writes m, b, u (3); quantize +
# pack reads u (0.5); decode writes d (0.5); apply reads x, d and writes x (1.5); minus the fused AdamW step the
# baseline pays (reads x, g, m, v, writes x, m, v: 3.5)
FUSED_CODEC_COPIES = 3 + 0.5 + 0.5 + 1.5 - 3.5


# ------------------------------------------------------------------------------------------------------ the model
def comm_time(method: str, d: int, k: int, L: int, net: dict, a: dict) -> float:
    """Seconds of communication per step (all buckets) on the bottleneck link."""
    n = k * L
    bw = net["gbit"] * net["efficiency"] * 1e9 / 8
    alpha = net["alpha_s"]
    bw_nv, alpha_nv = a["nvlink_GBps"] * 1e9, a["nvlink_alpha_s"]
    buckets = max(1, math.ceil(4 * d / (a["bucket_MiB"] * 2**20)))
    if n == 1:
        return 0.0
    link_bw, link_alpha = (bw, alpha) if k > 1 else (bw_nv, alpha_nv)
    if method in ("fp32", "fp16"):
        size = (4 if method == "fp32" else 2) * d
        return 2 * (n - 1) / n * size / link_bw + 2 * (n - 1) * link_alpha * buckets
    bits = d / 8
    sync = 2 * math.log2(n) * link_alpha  # the finite-flag all-reduce, once per step
    if method == "birder-allgather":
        return (n - 1) * bits / link_bw + (n - 1) * link_alpha * buckets + sync
    if method == "birder-scatter_gather":
        a2a = (L * (n - L) / n * bits if k > 1 else (n - 1) / n * bits) / link_bw
        return a2a + (n - 1) / n * bits / link_bw + 2 * (n - 1) * link_alpha * buckets + sync
    # hierarchical: NVLink all-to-all of the votes, inter-node exchange of the node bits, NVLink all-gather
    intra = (L - 1) / L * bits * (1 + max(1, k.bit_length())) / bw_nv + 2 * (L - 1) * alpha_nv * buckets
    if k == 1:
        return intra + sync
    if method == "birder-hierarchical":
        inter = (k - 1) * bits / bw + (k - 1) * alpha * buckets
    else:  # inter_method="scatter_gather"
        inter = 2 * (k - 1) / k * bits / bw + 2 * (k - 1) * alpha * buckets
    return intra + inter + sync


def step_time(compute: float, comm: float, codec: float, a: dict) -> dict:
    hidden = min(comm, a["overlap"] * a["backward_fraction"] * compute)
    exposed = comm - hidden
    return {
        "compute_s": compute,
        "codec_s": codec,
        "comm_s": comm,
        "exposed_comm_s": exposed,
        "step_s": compute + codec * (1 - a["codec_overlap"]) + exposed,
    }


def codec_time(method: str, d: int, copies: float, a: dict) -> float:
    if method == "fp32":
        return 0.0
    if method == "fp16":
        copies = 0.75  # cast to fp16 and back: reads 4 + writes 2, reads 2 + writes 4 bytes per element
    return copies * 8 * d / (a["gpu_hbm_GBps"] * 1e9 * a["gpu_hbm_efficiency"])


# ------------------------------------------------------------------------------------------------- calibration
def gpu_calibration(path: Path) -> dict | None:
    """Codec copy-equivalents per element measured on a GPU by ``device_check.py`` (``None``: no usable gpu.json).

    Per model, the hook record's ``codec_copies``; a model without one takes the compiled codec kernels' ratios
    (``codec.json``'s formula). A tiny (smoke test) or CPU run is not a measurement and is ignored.
    """
    if not path.exists():
        return None
    g = json.loads(path.read_text())
    dev = g.get("device", {})
    if g.get("tiny") or dev.get("type") != "cuda":
        return None
    # the codec cannot make a step cheaper; a Birder step below AdamW's (a lighter optimizer) counts as 0
    copies = {r["model"]: max(0.0, r["codec_copies"]) for r in g.get("hook", []) if r.get("model") in NUMEL}
    how = "hook step time minus AdamW's (DDP, one rank), in fp32 copies of the gradient timed in the same run"
    kernels = [c for c in g.get("codec", []) if c.get("compiled")]
    if len(copies) < len(NUMEL) and kernels:
        r = max(kernels, key=lambda c: c["numel"])["ratio_vs_copy"]
        for m in NUMEL:
            copies.setdefault(m, 3 + r["quantize+pack"] + r["unpack"] + 1.5)
        how += "; models without a hook record: the compiled codec kernels' ratios"
    if not copies:
        return None
    return {"copies": copies, "from": f"gpu.json ({dev.get('name')}, torch {dev.get('torch')}): {how}"}


def calibrate(results_dir: Path) -> dict:
    """Codec cost in copy-equivalents per element: measured on a GPU (gpu.json) if present, else on the CPU."""
    out = {"fused_copies": FUSED_CODEC_COPIES}
    codec = results_dir / "codec.json"
    cpu_copy = None
    if codec.exists():
        c = json.loads(codec.read_text())
        cpu_copy = c["ms"]["copy_ fp32"] / 1e3 / c["numel"]  # seconds per element of one fp32 copy_
        out["codec_json"] = {"ratio_vs_copy": c["ratio_vs_copy"], "cpu_copy_GBps": 8 / cpu_copy / 1e9}
    tp = results_dir / "throughput.json"
    if tp.exists():
        t = json.loads(tp.read_text())
        # the yardstick measured in the same job, by every rank at once: seconds per element of an fp32 copy_
        copy = {
            (r.get("profile"), r["model"], r["batch_per_proc"]): r["copy_s_per_elem"]
            for r in t["records"]
            if r.get("kind") == "meta" and r.get("copy_s_per_elem")
        }
        per_model: dict[str, list[float]] = {}
        for row in t["summary"]:
            b = row.get("breakdown")
            key = (row["profile"], row["model"], row["batch_per_proc"])
            if b and b.get("basis") == "cpu" and row["method"] == "birder-hierarchical" and key in copy:
                per_model.setdefault(row["model"], []).append(b["codec_s"] / NUMEL[row["model"]] / copy[key])
        if per_model:
            # the least disturbed run: other jobs' load only ever adds time
            out["measured_copies"] = {m: min(v) for m, v in per_model.items()}
            out["measured_copies_all"] = per_model
            out["measured_from"] = (
                "throughput.json: CPU seconds of ref-birder minus ref-compute (hook, codec, Birder's step in place of "
                "AdamW/SGDM) per element, in units of one fp32 copy_ timed in the same job; the smallest over runs"
            )
    if "measured_copies" not in out and "codec_json" in out:
        r = out["codec_json"]["ratio_vs_copy"]
        # encode (~3 copies when streamed) + quantize+pack + decode (~unpack) + apply (1.5)
        out["measured_copies"] = {m: 3 + r["quantize+pack"] + r["unpack"] + 1.5 for m in NUMEL}
        out["measured_from"] = "codec.json kernel ratios (no throughput.json yet)"
    gpu = gpu_calibration(results_dir / "gpu.json")
    if gpu is not None:
        if "measured_copies" in out:  # kept for comparison
            out["cpu_measured_copies"], out["cpu_measured_from"] = out.pop("measured_copies"), out.pop("measured_from")
        out["measured_copies"], out["measured_from"] = gpu["copies"], gpu["from"]
    out["source"] = "gpu" if gpu is not None else "cpu" if "measured_copies" in out else "fused default"
    return out


def predict(precision: str, calib: dict, codec_kind: str, a: dict = ASSUMPTIONS) -> list[dict]:
    rows = []
    L = a["gpus_per_node"]
    for model, d in NUMEL.items():
        measured = calib.get("measured_copies", {}).get(model, calib["fused_copies"])
        copies = calib["fused_copies"] if codec_kind == "fused" else measured
        for batch in a["batches_per_gpu"]:
            compute = batch / A100_SAMPLES_PER_S[precision][model]
            for net_name, net in NETWORKS.items():
                for k in a["nodes"]:
                    base = step_time(compute, comm_time("fp32", d, k, L, net, a), 0.0, a)
                    for method in METHODS:
                        st = step_time(
                            compute, comm_time(method, d, k, L, net, a), codec_time(method, d, copies, a), a
                        )
                        rows.append(
                            {
                                "model": model,
                                "batch": batch,
                                "network": net_name,
                                "nodes": k,
                                "method": method,
                                **st,
                                "speedup": base["step_s"] / st["step_s"],
                            }
                        )
    return rows


def check_testbed(results_dir: Path, a: dict = ASSUMPTIONS) -> list[dict]:
    """The same step formula on the testbed (2 nodes x 1 process): measured CPU compute, codec and communication
    CPU from ``throughput.json``, the measured inter-node bytes over the measured link bandwidth. Predicts what a
    dedicated machine (a core per rank, no other load) would show, next to what the shared one did."""
    tp = results_dir / "throughput.json"
    if not tp.exists():
        return []
    t = json.loads(tp.read_text())
    out = []
    for r in t["summary"]:
        b = r.get("breakdown")
        bw = (t.get("profiles", {}).get(r["profile"], {}) or {}).get("bandwidth_mbit")
        if not b or b.get("basis") != "cpu" or not bw or r.get("inter_node_tx_bytes_per_step") is None:
            continue
        net = r["inter_node_tx_bytes_per_step"] * 8 / (min(bw.values()) * 1e6)
        hidden = min(net, a["overlap"] * a["backward_fraction"] * b["compute_s"])
        pred = b["compute_s"] + b["codec_s"] + (b["comm_cpu_s"] or 0.0) + net - hidden
        out.append(
            {
                "profile": r["profile"],
                "model": r["model"],
                "batch_per_proc": r["batch_per_proc"],
                "method": r["method"],
                "network_s": net,
                "predicted_dedicated_step_s": pred,
                "measured_step_s": r["step_s"],
                "measured_ratio_vs_fp32": r["ratio_vs_fp32"],
                "measured_cpu_ratio_vs_fp32": r.get("cpu_ratio_vs_fp32"),
            }
        )
    for o in out:  # against the predicted fp32 step of the same configuration
        base = [
            x
            for x in out
            if (x["profile"], x["model"], x["batch_per_proc"]) == (o["profile"], o["model"], o["batch_per_proc"])
            and x["method"].startswith("fp32")
        ]
        if base:
            o["predicted_dedicated_ratio_vs_fp32"] = (
                base[0]["predicted_dedicated_step_s"] / o["predicted_dedicated_step_s"]
            )
    return out


def run(precision: str = "tf32", results_dir: Path = _HERE.parent / "docs" / "results") -> dict:
    calib = calibrate(results_dir)
    preds = predict(precision, calib, "measured")
    fused = predict(precision, calib, "fused")
    for p, f in zip(preds, fused):
        p["speedup_fused_codec"] = f["speedup"]
    paper = []
    for model in ("bert", "resnet50"):
        for batch in ASSUMPTIONS["batches_per_gpu"]:
            sel = {
                p["method"]: p
                for p in preds
                if p["model"] == model
                and p["batch"] == batch
                and p["network"] == PAPER["network"]
                and p["nodes"] == PAPER["nodes"]
            }
            paper.append(
                {
                    "model": model,
                    "batch": batch,
                    "paper_speedup": PAPER[model],
                    "predicted": {m: round(v["speedup"], 2) for m, v in sel.items()},
                    "predicted_fused_codec": {m: round(v["speedup_fused_codec"], 2) for m, v in sel.items()},
                    "fp32_step_ms": round(sel["fp32"]["step_s"] * 1e3, 1),
                    "birder_hierarchical_step_ms": round(sel["birder-hierarchical"]["step_s"] * 1e3, 1),
                    "compute_ms": round(sel["fp32"]["compute_s"] * 1e3, 1),
                }
            )
    return {
        "command": f"python benchmarks/cost_model.py --precision {precision}",
        "precision": precision,
        "a100_samples_per_s": A100_SAMPLES_PER_S[precision],
        "assumptions": ASSUMPTIONS,
        "networks": NETWORKS,
        "models": {m: {"numel": d, "batches": ASSUMPTIONS["batches_per_gpu"]} for m, d in NUMEL.items()},
        "methods": list(METHODS),
        "calibration": calib,
        "paper": PAPER,
        "paper_comparison": paper,
        "testbed_check": check_testbed(results_dir),
        "predictions": preds,
    }


def summary_table(result: dict) -> str:
    lines = [
        "| model | batch/GPU | network | nodes | fp16 | Birder allgather | Birder scatter_gather "
        "| Birder hierarchical | hierarchical (inter sg) | hierarchical, fused codec |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model in result["models"]:
        for batch in result["models"][model]["batches"]:
            for net in result["networks"]:
                for k in result["assumptions"]["nodes"]:
                    sel = {
                        p["method"]: p
                        for p in result["predictions"]
                        if p["model"] == model and p["batch"] == batch and p["network"] == net and p["nodes"] == k
                    }
                    lines.append(
                        f"| {model} | {batch} | {net} | {k} | {sel['fp16']['speedup']:.2f} "
                        f"| {sel['birder-allgather']['speedup']:.2f} | {sel['birder-scatter_gather']['speedup']:.2f} "
                        f"| {sel['birder-hierarchical']['speedup']:.2f} "
                        f"| {sel['birder-hierarchical-sg']['speedup']:.2f} "
                        f"| {sel['birder-hierarchical']['speedup_fused_codec']:.2f} |"
                    )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", choices=sorted(A100_SAMPLES_PER_S), default="tf32")
    ap.add_argument(
        "--results", default=str(_HERE.parent / "docs" / "results"), help="where codec/throughput.json are"
    )
    ap.add_argument("--out", default="docs/results/cost_model.json")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    result = {**run(args.precision, Path(args.results)), **provenance(__file__, argv)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    table = summary_table(result)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    calib = result["calibration"]
    print(
        f"\ncodec calibration ({calib['source']}-measured): {calib.get('measured_copies')} copy-equivalents per "
        f"element ({calib.get('measured_from')}); fused: {FUSED_CODEC_COPIES}"
    )
    for p in result["paper_comparison"]:
        print(
            f"paper {p['model']} b{p['batch']} (8 nodes, 10GbE): paper {p['paper_speedup']}x, predicted "
            f"hierarchical {p['predicted']['birder-hierarchical']}x (fused codec "
            f"{p['predicted_fused_codec']['birder-hierarchical']}x)"
        )
    nan = float("nan")
    for c in result["testbed_check"]:
        print(
            f"testbed {c['profile']} {c['model']} b{c['batch_per_proc']} {c['method']}: measured "
            f"{c['measured_step_s']:.2f} s ({c['measured_ratio_vs_fp32']:.2f}x), dedicated-machine estimate "
            f"{c['predicted_dedicated_step_s']:.2f} s ({c.get('predicted_dedicated_ratio_vs_fp32', nan):.2f}x)"
        )
    if not args.no_plot:
        sys.path.insert(0, str(_HERE))
        import plots

        print("wrote", plots.cost_model_figure(result, out.with_suffix(".png")))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
