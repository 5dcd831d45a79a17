"""Labelled charts and contact sheets: sizes, where content is drawn, and that labels really render."""

from __future__ import annotations

import numpy as np

from pfctl.utils.plot import PALETTE, contact_sheet, line_chart


def _pixels(img) -> np.ndarray:
    return np.asarray(img.convert("RGB"))


def test_line_chart_draws_each_series_in_its_colour_and_the_labels():
    xs = list(range(20))
    img = line_chart(
        {"a": (xs, [x * 0.1 for x in xs]), "b": (xs, [2 - x * 0.05 for x in xs])},
        title="Loss", xlabel="step", ylabel="loss", marks=[5, 10], marks_label="chunk boundary",
    )  # fmt: skip
    px = _pixels(img)
    assert img.size == (960, 540)
    for colour in PALETTE[:2]:  # both lines (and their legend swatches) are there
        assert (px == colour).all(axis=-1).sum() > 50
    assert (px[:40] < 100).all(axis=-1).any()  # the title's dark text at the top
    blank = line_chart({"a": (xs, [1.0] * 20)}, title="", xlabel="", ylabel="")
    assert (_pixels(blank)[:40] < 100).all(axis=-1).sum() < (px[:40] < 100).all(axis=-1).sum()


def test_line_chart_survives_empty_constant_and_log_series():
    line_chart({"empty": ([], [])}, title="t", xlabel="x", ylabel="y")
    line_chart({"one": ([3], [0.5])}, title="t", xlabel="x", ylabel="y")
    img = line_chart({"log": ([1, 2, 3], [1e-6, 0.0, 1e-2])}, title="t", xlabel="x", ylabel="y", log_y=True)
    assert (_pixels(img) == PALETTE[0]).all(axis=-1).any()


def test_contact_sheet_grid_holds_the_picked_frames():
    t, h, w = 9, 32, 48
    video = np.zeros((t, h, w, 3), np.uint8)
    for i in range(t):
        video[i, ..., 0] = 20 * i + 10  # each frame its own red level
    img = contact_sheet([("a red circle - step 3, seed 0", video)] * 2, title="validation", frames=3, cell=96)
    px = _pixels(img)
    reds = {int(v) for v in np.unique(px[..., 0][(px[..., 1] == 0) & (px[..., 2] == 0)])}
    assert {10, 90, 170} <= reds  # frames 1, 5 and 9 of 9 are shown
    assert img.width >= 3 * 96 and img.height > 2 * 96 * h / w


def test_contact_sheet_cuts_a_long_label_to_the_sheet_width():
    video = np.full((3, 16, 16, 3), 128, np.uint8)
    img = contact_sheet([("step 7 | seed 0 | " + "a very long caption " * 20, video)], title="t", frames=3, cell=64)
    px = _pixels(img)
    band = px[40:62]  # the row's label line, below the 40 px title
    assert (band < 100).all(axis=-1).any()  # the label is drawn
    assert (band[:, -8:] == 255).all()  # and stops before the right margin


def test_save_png_writes_what_was_drawn(tmp_path):
    from PIL import Image

    from pfctl.utils.plot import save_png

    img = line_chart({"a": ([0, 1], [0.0, 1.0])}, title="t", xlabel="x", ylabel="y")
    path = save_png(img, tmp_path / "chart.png")
    assert (np.asarray(Image.open(path).convert("RGB")) == _pixels(img)).all()
