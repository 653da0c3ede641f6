"""PNG plots for MLflow and the report: layer scores and the distribution of per-example influence."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no screen here, and none needed
import matplotlib.pyplot as plt  # noqa: E402


def layer_scores_plot(rows: list[dict], chosen: list[int], path: Path) -> Path:
    """Bars of S_l = F_l - R_l per layer, the edited band highlighted."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    layers = [r["layer"] for r in rows]
    colors = ["tab:red" if layer in chosen else "tab:gray" for layer in layers]
    ax.bar(layers, [r["score"] for r in rows], color=colors)
    ax.set_xlabel("layer")
    ax.set_ylabel("attribution score S_l = F_l - R_l")
    ax.set_title("Logit-lens layer scores (edited layers in red)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def influence_plot(rows: list[dict], path: Path) -> Path:
    """Histogram of ||P - P_-i||_F per module (log-spaced bins)."""
    import numpy as np

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for module in sorted({r["module"] for r in rows}):
        values = np.array([r["value"] for r in rows if r["module"] == module])
        values = values[values > 0]
        if values.size:
            bins = np.logspace(np.log10(values.min()), np.log10(values.max() * 1.0001), 20)
            ax.hist(values, bins=bins, alpha=0.5, label=module)
    ax.set_xscale("log")
    ax.set_xlabel("leave-one-out influence ||P - P_-i||_F")
    ax.set_ylabel("forget examples")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
