"""Training curves as a PNG: the loss (train/val), acc_k per TTT position and the simulated accept length
vs optimizer step, each panel titled, each axis labelled with its units, drawn for MLflow's preview width.
"""

from __future__ import annotations

from pathlib import Path

STEP_LABEL = "optimizer step (count)"


def build_training_figure(history: list[dict[str, float]]):
    """Three stacked panels from `Trainer.history` rows (`step`, `train/...`, `val/...`), drawn for MLflow's preview
    width (`eagle3.figures`): the weighted TTT loss (train solid, val dashed), acc_k per TTT position of one split
    (validation when there is one: one line per position, not two), and the simulated accept length at the full TTT
    depth, each evaluation a point with its value (a line through two points suggested a trend)."""
    from eagle3.figures import MIN_TEXT_PT, preview_figure

    fig, (ax_loss, ax_acc, ax_len) = preview_figure(3)
    for split, style in (("train", "-"), ("val", "--")):
        rows = [h for h in history if f"{split}/loss" in h]
        if rows:
            ax_loss.plot([h["step"] for h in rows], [h[f"{split}/loss"] for h in rows], style, label=f"{split} loss")
    split = "val" if any("val/acc_0" in h for h in history) else "train"
    rows = [h for h in history if f"{split}/acc_0" in h]
    depth = max((sum(1 for k in h if k.startswith(f"{split}/acc_")) for h in rows), default=0)
    for k in range(depth):
        points = [(h["step"], h[f"{split}/acc_{k}"]) for h in rows if f"{split}/acc_{k}" in h]
        ax_acc.plot(*zip(*points), "-", marker="o" if len(points) < 3 else None, markersize=4,
                    color=_shade(k, depth), label=f"{split} acc_{k}")
    lengths = [(h["step"], h["val/simulated_accept_length"]) for h in history if "val/simulated_accept_length" in h]
    if lengths:
        ax_len.plot(*zip(*lengths), "o", color="C2", label="val simulated accept length")
        for step, value in lengths[-3:]:
            ax_len.annotate(f"{value:.2f}", (step, value), textcoords="offset points", xytext=(0, 6), ha="center",
                            fontsize=MIN_TEXT_PT)
        ax_len.set_ylim(1, max(v for _, v in lengths) * 1.2)
    ax_loss.set(title="Training loss: soft cross-entropy, $\\sum_k$ decay$^k$ over TTT steps", xlabel=STEP_LABEL,
                ylabel="nats per token")
    ax_acc.set(title=f"$acc_k$ per TTT position, {split} (draft top-1 = target top-1)", xlabel=STEP_LABEL,
               ylabel="share (0-1)", ylim=(0, 1))
    ax_len.set(title=f"Simulated accept length, full depth {depth}: $1 + \\sum_k \\prod_{{j \\leq k}} acc_j$",
               xlabel=STEP_LABEL, ylabel="tokens / verify step")
    for ax in (ax_loss, ax_acc, ax_len):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(ncol=4 if ax is ax_acc else 2, loc="lower right" if ax is ax_acc else "best")
    return fig


def _shade(k: int, depth: int):
    """Position k's colour: one colour map from the first position (dark) to the last (light), so 7 lines read as
    an order, not as 7 unrelated series."""
    import matplotlib

    return matplotlib.colormaps["viridis"](0.85 * k / max(depth - 1, 1))


def plot_training_curves(history: list[dict[str, float]], out_png: Path) -> Path:
    """`build_training_figure(history)` saved as a PNG at out_png (parents created); returns the path."""
    import matplotlib.pyplot as plt

    fig = build_training_figure(history)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)  # at the figure's own dpi (eagle3.figures.SAVE_DPI)
    plt.close(fig)
    return out_png
