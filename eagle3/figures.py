"""The size every eagleops figure is drawn for: MLflow's artifact preview, where a person reads it.

MLflow 3.17 shows a PNG artifact scaled to the width of its artifact pane: 679 px at a 1600 px wide window with its
Assistant panel open (issue 35's measure; the pane is narrower than the window by the run page's sidebar, the artifact
tree and the Assistant). A figure drawn 16 inches wide showed its 8 pt labels ~5 px high there. So figures are drawn
`PREVIEW_WIDTH_PX` wide at `PREVIEW_DPI` (1 inch = 100 preview px; a 9 pt label is 12.5 px high in the preview),
panels stacked, not side by side, and saved at `SAVE_DPI` (twice the pixels, for HiDPI screens and zooming in).
At the bottom of eagle3, beside config and environment: it imports nothing of eagle3, and both the training curves
(eagle3.training) and the benchmark figure (tasks.stages.bench) draw with it.
"""

from __future__ import annotations

PREVIEW_WIDTH_PX = 680
PREVIEW_DPI = 100
SAVE_DPI = 200
MIN_TEXT_PT = 9  # 12.5 px at the preview's scale; MLflow's own UI text is 13 px


def preview_figure(rows: int, row_height_in: float = 2.9):
    """A figure of `rows` stacked panels, `PREVIEW_WIDTH_PX` wide at the preview's scale, text at least
    `MIN_TEXT_PT`; (figure, axes list)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with plt.rc_context({"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "xtick.labelsize": MIN_TEXT_PT,
                         "ytick.labelsize": MIN_TEXT_PT, "legend.fontsize": MIN_TEXT_PT,
                         "figure.titlesize": 12, "savefig.dpi": SAVE_DPI}):
        fig, axes = plt.subplots(rows, 1, figsize=(PREVIEW_WIDTH_PX / PREVIEW_DPI, rows * row_height_in + 0.6),
                                 dpi=SAVE_DPI, layout="constrained")
    return fig, list(axes) if rows > 1 else [axes]


def preview_text_px(fontsize_pt: float) -> float:
    """How high a `fontsize_pt` text of a preview figure shows in MLflow's preview (px)."""
    return fontsize_pt * PREVIEW_DPI / 72
