"""Training curves as a PNG: loss (train/val) and acc_k per TTT position vs step.
"""

from __future__ import annotations

from pathlib import Path


def plot_training_curves(history: list[dict[str, float]], out_png: Path) -> Path:
    """Loss (train/val) and acc_k per TTT position (train solid, val dashed) vs step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    for split, style in (("train", "-"), ("val", "--")):
        rows = [h for h in history if f"{split}/loss" in h]
        if rows:
            ax_loss.plot([h["step"] for h in rows], [h[f"{split}/loss"] for h in rows], style, label=f"{split} loss")
        k = 0
        while rows and f"{split}/acc_{k}" in rows[0]:
            ax_acc.plot([h["step"] for h in rows], [h[f"{split}/acc_{k}"] for h in rows], style,
                        color=f"C{k % 10}", label=f"{split} acc_{k}")
            k += 1
    ax_loss.set(xlabel="optimizer step", ylabel="weighted TTT loss", title="loss")
    ax_acc.set(xlabel="optimizer step", ylabel="accuracy", title="acc_k per TTT position", ylim=(0, 1))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
