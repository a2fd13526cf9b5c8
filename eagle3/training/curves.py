"""Training curves as a PNG: the loss (train/val), acc_k per TTT position and the simulated accept length
vs optimizer step, each panel titled, each axis labelled with its units.
"""

from __future__ import annotations

from pathlib import Path

STEP_LABEL = "optimizer step (count)"


def build_training_figure(history: list[dict[str, float]]):
    """Three panels from `Trainer.history` rows (`step`, `train/...`, `val/...`), train solid, val dashed:
    the weighted TTT loss, acc_k per TTT position and the validation's simulated accept length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc, ax_len) = plt.subplots(1, 3, figsize=(17, 4.5))
    for split, style in (("train", "-"), ("val", "--")):
        rows = [h for h in history if f"{split}/loss" in h]
        steps = [h["step"] for h in rows]
        if rows:
            ax_loss.plot(steps, [h[f"{split}/loss"] for h in rows], style, label=f"{split} loss")
        k = 0
        while rows and f"{split}/acc_{k}" in rows[0]:
            ax_acc.plot(steps, [h[f"{split}/acc_{k}"] for h in rows], style, color=f"C{k % 10}",
                        label=f"{split} acc_{k}")
            k += 1
        lengths = [(h["step"], h[f"{split}/simulated_accept_length"]) for h in rows
                   if f"{split}/simulated_accept_length" in h]
        if lengths:
            ax_len.plot(*zip(*lengths), style, marker="o", label=f"{split} simulated accept length")
    ax_loss.set(title="Training loss (soft cross-entropy, sum over TTT steps x decay^k)", xlabel=STEP_LABEL,
                ylabel="loss (nats per token, summed over steps)")
    ax_acc.set(title="acc_k per TTT position (draft top-1 = target top-1)", xlabel=STEP_LABEL,
               ylabel="acc_k (share of loss-masked positions, 0-1)", ylim=(0, 1))
    ax_len.set(title="Simulated accept length (1 + sum_k prod_{j<=k} acc_j)", xlabel=STEP_LABEL,
               ylabel="tokens per verify step")
    for ax in (ax_loss, ax_acc, ax_len):
        ax.title.set_fontsize(10)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def plot_training_curves(history: list[dict[str, float]], out_png: Path) -> Path:
    """`build_training_figure(history)` saved as a PNG at out_png (parents created); returns the path."""
    import matplotlib.pyplot as plt

    fig = build_training_figure(history)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
