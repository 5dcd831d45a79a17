"""The synthetic shapes dataset and its scorer: real mp4 clips, deterministic, captions = content."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pfctl.demo.score import rgb_to_hsv, score_annotations, score_clips, score_frames
from pfctl.demo.shapes import (
    BACKGROUND,
    COLORS,
    DEFAULT_COLORS,
    DIRECTIONS,
    SHAPES,
    ShapeClip,
    caption_for,
    make_shapes,
    parse_caption,
    plan_clips,
    render_clip,
)
from pfctl.errors import ConfigError

NUM_CLIPS = len(DEFAULT_COLORS) * len(SHAPES) * len(DIRECTIONS)  # every class combination once
SIZE = (64, 48)
NUM_FRAMES = 17
FPS = 12


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_shapes(tmp_path_factory.mktemp("shapes"), NUM_CLIPS, SIZE, NUM_FRAMES, FPS, seed=7)


def test_files_and_annotations(dataset):
    rows = [json.loads(line) for line in dataset.annotation_file.read_text().splitlines()]
    assert len(rows) == NUM_CLIPS == len(dataset.video_paths)
    for row, clip in zip(rows, dataset.clips, strict=True):
        assert row["text"] == clip.caption == caption_for(row["color"], row["shape"], row["direction"])
        assert not Path(row["video"]).is_absolute()
        assert (dataset.annotation_file.parent / row["video"]).is_file()
        assert (row["num_frames"], row["fps"], row["width"], row["height"]) == (NUM_FRAMES, FPS, *SIZE)
    combos = Counter((r["color"], r["shape"], r["direction"]) for r in rows)
    assert len(combos) == NUM_CLIPS  # balanced: each combination exactly once
    meta = json.loads((dataset.root / "shapes_meta.json").read_text())
    assert meta["seed"] == 7 and len(meta["clips"]) == NUM_CLIPS


def test_frame_count_size_fps_read_back_with_decord(dataset):
    import decord

    for path in dataset.video_paths[:5]:
        reader = decord.VideoReader(str(path), ctx=decord.cpu(0))
        assert len(reader) == NUM_FRAMES
        assert reader[0].shape == (SIZE[1], SIZE[0], 3)
        assert reader.get_avg_fps() == pytest.approx(FPS)


def test_captions_match_content_100_percent(dataset):
    report = score_annotations(dataset.annotation_file, colors=DEFAULT_COLORS)
    bad = [r for r in report.rows if not (r["color_ok"] and r["direction_ok"])]
    assert report.num_clips == NUM_CLIPS
    assert report.color_accuracy == 1.0 and report.direction_accuracy == 1.0, bad
    assert report.shape_accuracy == 1.0, [
        (r["caption"], r["shape"]) for r in report.rows if not r["shape_ok"]
    ]


def test_scorer_is_not_limited_to_the_default_palette(dataset):
    """Against the whole palette (6 hues), ground-truth clips still score 100 %."""
    report = score_annotations(dataset.annotation_file)
    assert report.color_accuracy == 1.0 and report.direction_accuracy == 1.0


def test_deterministic_bytes_and_prefix_stable(dataset, tmp_path):
    again = make_shapes(tmp_path / "again", 6, SIZE, NUM_FRAMES, FPS, seed=7)
    for path_a, path_b in zip(dataset.video_paths[:6], again.video_paths, strict=True):
        assert path_a.read_bytes() == path_b.read_bytes()
    assert again.clips == plan_clips(6, SIZE, NUM_FRAMES, 7)
    other = plan_clips(6, SIZE, NUM_FRAMES, 8)
    assert [c.start for c in other] != [c.start for c in again.clips]


def test_shapes_stay_inside_the_frame_and_move():
    for clip in plan_clips(NUM_CLIPS, SIZE, NUM_FRAMES, seed=3):
        frames = render_clip(clip, SIZE, NUM_FRAMES)
        assert frames.shape == (NUM_FRAMES, SIZE[1], SIZE[0], 3)
        border = np.concatenate([frames[:, 0], frames[:, -1], frames[:, :, 0], frames[:, :, -1]], axis=1)
        assert (border == np.asarray(BACKGROUND, dtype=np.uint8)).all(), clip
        ux, uy = DIRECTIONS[clip.direction]
        assert np.sign(clip.velocity[0]) == ux and np.sign(clip.velocity[1]) == uy
        assert not np.array_equal(frames[0], frames[-1])


@pytest.mark.parametrize("color", sorted(COLORS))
@pytest.mark.parametrize("direction", sorted(DIRECTIONS))
def test_score_frames_every_palette_colour_and_direction(color, direction):
    shape = SHAPES[hash((color, direction)) % len(SHAPES)]
    ux, uy = DIRECTIONS[direction]
    clip = ShapeClip(
        "x", color, shape, direction, "", 8.0, (32 - 14 * ux, 32 - 14 * uy), (1.75 * ux, 1.75 * uy)
    )
    result = score_frames(render_clip(clip, (64, 64), 17))
    assert (result.color, result.direction) == (color, direction)
    assert result.visible_frames == 17


@pytest.mark.parametrize("shape", SHAPES)
def test_score_frames_reads_the_shape_at_every_size(shape):
    """The silhouette tells a circle, a square and a triangle apart at every size the data set draws."""
    for half in (7.7, 9.5, 11.5):
        clip = ShapeClip("x", "green", shape, "down", "", half, (30.3, 14.0), (0.0, 2.0))
        assert score_frames(render_clip(clip, (64, 64), 17)).shape == shape, half


def test_score_static_and_empty_clips():
    clip = ShapeClip("x", "red", "square", "left", "", 8.0, (32.0, 32.0), (0.0, 0.0))
    static = score_frames(render_clip(clip, (64, 64), 9))
    assert static.color == "red" and static.direction is None
    empty = score_frames(np.full((9, 32, 32, 3), 24, dtype=np.uint8))
    assert (empty.color, empty.direction, empty.visible_frames, empty.shape) == (None, None, 0, None)


def test_score_clips_accepts_frames_and_reports_mismatches():
    clip = ShapeClip("x", "blue", "circle", "right", "", 8.0, (18.0, 32.0), (1.75, 0.0))
    frames = render_clip(clip, (64, 64), 17)
    report = score_clips([("a blue circle moving right", frames), ("a red circle moving left", frames)])
    assert report.color_accuracy == 0.5 and report.direction_accuracy == 0.5 and report.both_accuracy == 0.5


def test_rgb_to_hsv_primaries():
    hue, sat, val = rgb_to_hsv(
        np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [128, 128, 128]], dtype=np.uint8)
    )
    assert hue[:3].tolist() == [0.0, 120.0, 240.0]
    assert sat.tolist() == [1.0, 1.0, 1.0, 0.0]
    assert val[3] == pytest.approx(128 / 255)


def test_parse_caption():
    assert parse_caption("a red circle moving left") == ("red", "circle", "left")
    assert parse_caption("A Yellow triangle, moving UP, hyper quality") == ("yellow", "triangle", "up")
    assert parse_caption("something else") == (None, None, None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_clips": 0}, "num_clips"),
        ({"size": (63, 64)}, "even"),
        ({"size": (8, 8)}, ">= 16"),
        ({"num_frames": 1}, "num_frames"),
        ({"colors": ("red", "magenta")}, "magenta"),
        ({"shapes": ("hexagon",)}, "hexagon"),
    ],
)
def test_make_shapes_rejects_bad_arguments(tmp_path, kwargs, match):
    args = {"num_clips": 2, "size": (32, 32), "num_frames": 9, "fps": 8, "seed": 0} | kwargs
    with pytest.raises(ConfigError, match=match):
        make_shapes(tmp_path / "d", **args)
    assert not (tmp_path / "d" / "annotations.jsonl").exists()
