"""Pareto plots from the e2e JSON files, drawn the way DeepSeek publishes them.

    python -m benchmarks.plots results/

prefill_pareto.png: prompt tokens/s (throughput) against the batch's latency, one point per
(batch, length). decode_pareto.png: output tokens/s per GPU against tokens/s per user, one curve
per context length across batch sizes, with the HBM-floor curve (the fastest any implementation
could step) dashed beside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(result_dir: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("the plots need matplotlib: pip install 'deepinfer[bench]' (or pip install matplotlib)") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [json.loads(p.read_text()) for p in sorted(result_dir.glob("e2e_*.json"))]
    written = []
    if not reports:
        return written
    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4.5), squeeze=False)
    for ax, rep in zip(axes[0], reports):
        pts = rep["prefill"]
        ax.scatter([p["latency_s"] for p in pts], [p["tokens_per_s"] for p in pts])
        for p in pts:
            ax.annotate(f"{p['batch']}x{p['length']}", (p["latency_s"], p["tokens_per_s"]), fontsize=7)
        ax.set(xscale="log", xlabel="latency of the batch (s)", ylabel="prompt tokens/s per GPU", title=f"{rep['model']}: prefill")
        ax.grid(alpha=0.3)
    path = result_dir / "prefill_pareto.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    written.append(path)

    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4.5), squeeze=False)
    for ax, rep in zip(axes[0], reports):
        contexts = sorted({p["context"] for p in rep["decode"]})
        for i, ctx in enumerate(contexts):
            pts = sorted((p for p in rep["decode"] if p["context"] == ctx), key=lambda p: p["batch"])
            color = f"C{i}"
            ax.plot([p["tokens_per_s_per_user"] for p in pts], [p["tokens_per_s"] for p in pts], "o-", color=color, label=f"context {ctx}")
            ax.plot([1 / p["hbm_floor_s"] for p in pts], [p["batch"] / p["hbm_floor_s"] for p in pts], "--", color=color, alpha=0.5)
            for p in pts:
                ax.annotate(str(p["batch"]), (p["tokens_per_s_per_user"], p["tokens_per_s"]), fontsize=7)
        peer = rep.get("transformers")
        if peer:
            ax.scatter([1 / peer["step_s"]], [peer["decode_tokens_per_s"]], marker="x", color="k", label=f"transformers B={peer['batch']} L={peer['context']}")
        ax.set(xscale="log", yscale="log", xlabel="output tokens/s per user", ylabel="output tokens/s per GPU",
               title=f"{rep['model']}: decode (dashed: HBM floor)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    path = result_dir / "decode_pareto.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    written.append(path)
    return written


if __name__ == "__main__":
    for p in plot(Path(sys.argv[1] if len(sys.argv) > 1 else "bench_results")):
        print(f"wrote {p}")
