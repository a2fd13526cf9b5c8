"""benchmark.png and training_curves.png as MLflow previews them: each PNG's size read back from the file, and every
text it was drawn with checked at the preview's scale (`eagle3.figures`: 680 px wide, MLflow 3.17's artifact pane at
a 1600 px window); bars carry their values and the verdict is in the benchmark figure. The PNGs are kept under the
test's tmp dir (paths printed)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from eagle3.figures import MIN_TEXT_PT, PREVIEW_WIDTH_PX, SAVE_DPI, preview_text_px
from eagle3.training.curves import build_training_figure, plot_training_curves
from tasks.stages.bench.report import benchmark_figure
from tests.tasks.stages.test_report_bench import measured  # noqa: F401  (fixture)

MIN_PREVIEW_TEXT_PX = 12.0  # a 9 pt label; the issue measured ~5 px on the old 16-inch figures


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def texts(figure) -> list:
    found = [t for t in figure.findobj(lambda a: hasattr(a, "get_fontsize") and hasattr(a, "get_text"))
             if t.get_text().strip() and t.get_visible()]
    return found


def assert_reads_in_the_preview(figure, png: Path) -> float:
    """The PNG is drawn for the preview width; its smallest text is at least MIN_PREVIEW_TEXT_PX high there."""
    width, height = png_size(png)
    assert width == PREVIEW_WIDTH_PX * SAVE_DPI // 100, (width, height)
    scale = PREVIEW_WIDTH_PX / width  # how MLflow shrinks it
    smallest = min(t.get_fontsize() for t in texts(figure))
    in_png = smallest * SAVE_DPI / 72
    assert in_png * scale == pytest.approx(preview_text_px(smallest))
    assert smallest >= MIN_TEXT_PT and in_png * scale >= MIN_PREVIEW_TEXT_PX, (smallest, in_png * scale)
    print(f"{png}: {width}x{height} px, shown {PREVIEW_WIDTH_PX}x{round(height * scale)}; smallest text "
          f"{smallest:g} pt = {in_png:.1f} px in the file, {in_png * scale:.1f} px in the preview")
    return in_png * scale


def test_benchmark_png_reads_at_mlflows_preview_width(measured, tmp_path):  # noqa: F811
    _, rows, offline, verdict = measured
    figure = benchmark_figure(rows, offline, verdict)
    png = tmp_path / "benchmark.png"
    figure.savefig(png)
    assert_reads_in_the_preview(figure, png)
    shown = {t.get_text() for t in texts(figure)}
    assert "verdict: best speculative 3/1/4: 1.61x the baseline" in shown  # the answer, in the figure
    assert {"1266.8\n1.61x", "784.9", "3.35", "2.30"} <= shown, shown  # values on the bars, speedup on its bar
    throughput = figure.axes[0]
    assert [t.get_text() for t in throughput.get_xticklabels()] == ["baseline", "spec 3/1/4"]  # a bar, not a line
    assert not throughput.get_legend()


def test_training_curves_png_reads_at_mlflows_preview_width(tmp_path):
    history = [{"step": s, "train/loss": 9.0 - s / 10, **{f"train/acc_{k}": 0.2 + s / 100 for k in range(7)}}
               for s in range(1, 31)]
    history += [{"step": s, "val/loss": 8.0, **{f"val/acc_{k}": 0.8 - k / 20 for k in range(7)},
                 "val/simulated_accept_length": 4.1 + s / 100} for s in (10, 30)]
    png = plot_training_curves(history, tmp_path / "training_curves.png")
    figure = build_training_figure(history)
    assert_reads_in_the_preview(figure, png)
    loss, acc, length = figure.axes
    assert len(acc.lines) == 7  # one split's positions (validation), not 14 overlapping lines
    assert "$" in length.get_title() and "full depth 7" in length.get_title()  # mathtext, and which depth
    assert length.get_ylim()[0] == 1 and not any(line.get_linestyle() == "-" for line in length.lines)
    assert {"4.20", "4.40"} <= {t.get_text() for t in texts(figure)}
