"""Figures for the communication benchmarks (matplotlib, Agg): throughput bars, time breakdowns, cost-model curves.

Used by ``benchmarks/system/throughput.py`` and ``benchmarks/cost_model.py``; also runnable to redraw from saved JSON::

    python benchmarks/plots.py docs/results/throughput.json
    python benchmarks/plots.py docs/results/cost_model.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODEL_NAMES = {"bert": "BERT-Base (QA, seq 128)", "resnet50": "ResNet-50", "tiny-bert": "tiny BERT", "tiny-mlp": "MLP"}
METHOD_STYLE = {  # label, color (fp32 grey, torch hooks blue/purple, Birder oranges)
    "fp32-adamw": ("DDP fp32\n(AdamW)", "#7f7f7f"),
    "fp32-sgdm": ("DDP fp32\n(SGDM)", "#a6a6a6"),
    "fp16": ("fp16\nhook", "#1f77b4"),
    "powersgd": ("PowerSGD\nrank 4", "#9467bd"),
    "birder-allgather": ("Birder\nallgather", "#fdae6b"),
    "birder-scatter_gather": ("Birder\nscatter-\ngather", "#fd8d3c"),
    "birder-hierarchical": ("Birder\nhierarchical", "#d94801"),
    "birder-hierarchical-sg": ("Birder hierarchical\n(inter scatter_gather)", "#7f2704"),
    "onebitadam": ("1-bit\nAdam", "#2ca02c"),
}
PARTS = (
    ("compute_s", "compute", "#4c72b0"),
    ("codec_s", "codec", "#dd8452"),
    ("comm_cpu_s", "communication (CPU)", "#8c8c8c"),
    ("wait_s", "waiting (network, other rank, a busy machine)", "#c44e52"),
)


def _save(fig, title: str, path):
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _grid(rows: list[dict]):
    models = list(dict.fromkeys(r["model"] for r in rows))
    batches = {m: sorted({r["batch_per_proc"] for r in rows if r["model"] == m}) for m in models}
    ncols = max(len(b) for b in batches.values())
    fig, axes = plt.subplots(len(models), ncols, figsize=(5.2 * ncols, 3.9 * len(models)), squeeze=False)
    return fig, axes, models, batches


def _seed_label(result: dict, model: str, batch: int) -> str:
    ours = result["config"]["batches"].get(model, [])
    seed = result["config"].get("seed_batches", {}).get(model, [])
    if batch in ours and len(seed) == len(ours):
        return f"{batch}/process  (stands for {seed[ours.index(batch)]}/GPU)"
    return f"{batch}/process"


def _profile_title(result: dict, profile: str) -> str:
    info = result.get("profiles", {}).get(profile, {})
    bw = info.get("bandwidth_mbit") or {}
    c = result["config"]
    layout = f"{c['nodes']} nodes x {c['nproc_per_node']} process"
    if profile == "ethernet":
        rate = info.get("testbed", {}).get("rate_mbit")
        got = f", measured {min(bw.values()):.0f} Mbit/s" if bw else ""
        return f"ethernet profile: {rate:g} Mbit/s link{got} (~10 GbE between A100 nodes, scaled); {layout}"
    if profile == "ib":
        got = f" (measured {min(bw.values()) / 1000:.1f} Gbit/s)" if bw else ""
        return f"ib profile: unshaped veth{got}, bandwidth to spare; {layout}"
    return f"{profile}; {layout}"


def throughput_figures(result: dict, outdir: Path, stem: str = "throughput") -> list[Path]:
    """One bar chart of samples/s per profile (the seed's "system throughput" figures) and one stacked bar chart
    of the per-step time breakdown per profile. Returns the paths written."""
    outdir = Path(outdir)
    paths = []
    for profile in dict.fromkeys(r["profile"] for r in result["summary"]):
        rows = [r for r in result["summary"] if r["profile"] == profile]
        # samples/s
        fig, axes, models, batches = _grid(rows)
        for i, model in enumerate(models):
            for j, batch in enumerate(batches[model]):
                ax = axes[i][j]
                sel = [r for r in rows if r["model"] == model and r["batch_per_proc"] == batch]
                labels = [METHOD_STYLE.get(r["method"], (r["method"], "k"))[0] for r in sel]
                colors = [METHOD_STYLE.get(r["method"], (r["method"], "k"))[1] for r in sel]
                vals = [r["samples_per_s"] for r in sel]
                bars = ax.bar(range(len(sel)), vals, color=colors)
                for bar, r in zip(bars, sel):
                    if r["ratio_vs_fp32"] is not None:
                        cpu = r.get("cpu_ratio_vs_fp32")
                        ax.annotate(
                            f"{r['ratio_vs_fp32']:.2f}x" + (f"\n({cpu:.2f}x)" if cpu else ""),
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center",
                            va="bottom",
                            fontsize=8,
                        )
                ax.set_xticks(range(len(sel)), labels, fontsize=7)
                ax.set_ylabel("samples/s (all ranks)")
                ax.set_ylim(0, max(vals) * 1.25 if vals else 1)
                ax.set_title(f"{MODEL_NAMES.get(model, model)}, {_seed_label(result, model, batch)}", fontsize=9)
                ax.grid(axis="y", alpha=0.3)
            for j in range(len(batches[model]), axes.shape[1]):
                axes[i][j].axis("off")
        title = (
            f"System throughput, {_profile_title(result, profile)}\n(labels: x samples/s of DDP fp32; in brackets: "
            "fp32's CPU seconds per step / the method's: the work, without waiting for a core or the network)"
        )
        paths.append(_save(fig, title, outdir / f"{stem}_{profile}.png"))
        # breakdown
        fig, axes, models, batches = _grid(rows)
        for i, model in enumerate(models):
            for j, batch in enumerate(batches[model]):
                ax = axes[i][j]
                sel = [r for r in rows if r["model"] == model and r["batch_per_proc"] == batch and r["breakdown"]]
                bottom = [0.0] * len(sel)
                for key, name, color in PARTS:
                    vals = [max(0.0, r["breakdown"].get(key) or 0.0) for r in sel]
                    ax.bar(range(len(sel)), vals, bottom=bottom, color=color, label=name)
                    bottom = [b + v for b, v in zip(bottom, vals)]
                for k, r in enumerate(sel):
                    ax.plot([k - 0.4, k + 0.4], [r["step_s"]] * 2, color="k", lw=1)
                ax.set_xticks(
                    range(len(sel)), [METHOD_STYLE.get(r["method"], (r["method"], "k"))[0] for r in sel], fontsize=7
                )
                ax.set_ylabel("seconds per step")
                ax.set_title(f"{MODEL_NAMES.get(model, model)}, {_seed_label(result, model, batch)}", fontsize=9)
                ax.grid(axis="y", alpha=0.3)
                if i == 0 and j == 0:
                    ax.legend(fontsize=7, loc="upper right")
            for j in range(len(batches[model]), axes.shape[1]):
                axes[i][j].axis("off")
        title = (
            f"Time per step, {_profile_title(result, profile)}\n(CPU seconds of compute and codec from "
            "no-communication runs interleaved with the methods; waiting = measured step (black line) - CPU time)"
        )
        paths.append(_save(fig, title, outdir / f"{stem}_{profile}_breakdown.png"))
    return paths


def cost_model_figure(result: dict, path: Path) -> Path:
    """Predicted speedup over fp32 DDP vs number of nodes: one panel per network, one line per model x method."""
    nets = list(result["networks"])
    models = list(result["models"])
    fig, axes = plt.subplots(len(models), len(nets), figsize=(5.5 * len(nets), 3.9 * len(models)), squeeze=False)
    batches = sorted({p["batch"] for p in result["predictions"]})
    dashes = dict(zip(batches, ["-", "--", ":", "-."]))
    for i, model in enumerate(models):
        for j, net in enumerate(nets):
            ax = axes[i][j]
            handles = []
            for method in result["methods"]:
                if method.startswith("fp32"):
                    continue
                label, color = METHOD_STYLE.get(method, (method, "k"))
                for batch in batches:
                    pts = sorted(
                        (
                            p
                            for p in result["predictions"]
                            if (p["model"], p["network"], p["method"], p["batch"]) == (model, net, method, batch)
                        ),
                        key=lambda p: p["nodes"],
                    )
                    (line,) = ax.plot(
                        [p["nodes"] for p in pts],
                        [p["speedup"] for p in pts],
                        dashes[batch],
                        color=color,
                        marker="o",
                        ms=3,
                    )
                line.set_label(label.replace("\n", " "))
                handles.append(line)
            for batch in batches:
                (h,) = ax.plot([], [], dashes[batch], color="k", label=f"{batch} samples/GPU")
                handles.append(h)
            head = result["paper"].get(model)
            if head and net == result["paper"]["network"]:
                (h,) = ax.plot([8], [head], "k*", ms=12, label=f"paper: up to {head}x (8 nodes)")
                handles.append(h)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
            ax.set_xlabel("nodes (x 8 A100)")
            ax.set_ylabel("speedup over fp32 DDP")
            ax.set_title(f"{MODEL_NAMES.get(model, model)}, {result['networks'][net]['label']}", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(handles=handles, fontsize=6, loc="best")
    fig.suptitle("Alpha-beta cost model: predicted speedup of Birder (and fp16) over fp32 DDP", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for name in argv:
        path = Path(name)
        result = json.loads(path.read_text())
        if "predictions" in result:
            print("wrote", cost_model_figure(result, path.with_suffix(".png")))
        else:
            for p in throughput_figures(result, path.parent, stem=path.stem):
                print("wrote", p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
