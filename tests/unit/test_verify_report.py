"""The report: stable JSON key set, judging against the tolerance table, PNG plot."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console

from pfctl.config import load_config
from pfctl.models.diffusers_vae import load_diffusers_vae
from pfctl.verify.audit import EXACT, STATS
from pfctl.verify.plot import latent_boundaries, plot_per_frame_error
from pfctl.verify.report import AUDIT_KEYS, PATH_KEYS, SCHEMA_VERSION, TOP_KEYS, render
from pfctl.verify.run import bf16_copy, run_verify, tolerance_class, weights_kind, write_outputs

SMALL = {
    "verify.num_frames": 17,
    "verify.height": 16,
    "verify.width": 16,
    "verify.chunk_sizes": [4],
    "verify.memory": True,
}


@pytest.fixture(scope="module")
def cog_report():
    # no memory measurement: its tests read none, and each reading of malloc's counter walks the whole heap
    # (slow in a long test session); the wan report's keeps it
    return run_verify(load_config(flags={**SMALL, "verify.vae": "cogvideox-tiny", "verify.memory": False}))


@pytest.fixture(scope="module")
def wan_report():
    return run_verify(load_config(flags={**SMALL, "verify.vae": "wan-tiny"}))


def test_json_schema_key_set(wan_report, tmp_path):
    write_outputs(wan_report, str(tmp_path / "r.json"), None)
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data) == TOP_KEYS
    assert data["schema_version"] == SCHEMA_VERSION == 1
    assert set(data["audit"]) == AUDIT_KEYS
    for path in data["paths"]:
        assert set(path) == PATH_KEYS
    assert [p["name"] for p in data["paths"]] == ["library", "chunk-4", "exact"]
    lib = data["paths"][0]
    assert set(lib["latent"]) == {
        "max_abs",
        "mean_abs",
        "rel_l2",
        "per_frame_rel_l2",
        "channel_mean_shift",
        "channel_std_shift",
    }
    assert set(lib["decoded"]) == {
        "psnr_vs_full",
        "psnr_full_vs_input",
        "psnr_vs_input",
        "delta_psnr",
        "flicker",
    }
    assert set(lib["drift"]) == {"threshold", "max_d_mu", "max_d_sigma", "first_over", "layers"}
    assert set(data["memory"]) == {
        "method",
        "frames",
        "one_call_bytes",
        "exact_bytes",
        "ratio",
        "exact_held_bytes",
    }
    assert set(data["noise_floor"]) == {"rel_l2", "max_abs"}


@pytest.mark.slow
def test_cogvideox_report(cog_report):
    r = cog_report
    assert r.audit["verdict"] == "STATS-COUPLED"
    assert r.vae["weights"] == "random" and any("demonstration of the algebra" in n for n in r.notes)
    lib, exact = r.path("library"), r.path("exact")
    assert lib.tolerance_class == "approximate" and lib.latent["rel_l2"] > 1e-3
    assert lib.drift["max_d_mu"] > 0 and lib.drift["first_over"]
    assert exact.tolerance_class == "exact" and exact.status == "pass"
    assert exact.latent["rel_l2"] <= 1e-5
    assert exact.drift["max_d_mu"] < 1e-4  # the pooled statistics equal the one-call ones
    assert r.noise_floor["rel_l2"] > 0 and exact.bf16["ratio_to_floor"] <= 2
    assert r.exit_code == (1 if r.status == "fail" else 0)


def test_wan_report_passes(wan_report):
    r = wan_report
    assert r.audit["verdict"] == "EXACT-CHUNKABLE"
    assert r.status == "pass" and r.exit_code == 0
    for p in r.paths:
        assert p.tolerance_class == "exact" and p.latent["rel_l2"] <= 1e-5
        assert p.bf16 is None or p.bf16["ratio_to_floor"] <= 2


def test_png_is_readable_alone(wan_report, monkeypatch):
    """The plot names the VAE, the verdict and the result, labels both axes, and has a legend entry per path."""
    from PIL import Image, ImageDraw

    texts: list[str] = []
    original = ImageDraw.ImageDraw.text

    def spy(self, xy, text, *args, **kwargs):
        texts.append(text)
        return original(self, xy, text, *args, **kwargs)

    monkeypatch.setattr(ImageDraw.ImageDraw, "text", spy)
    data = plot_per_frame_error(wan_report, width=900, height=480)
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG" and image.size == (900, 480)
    title = texts[0]
    assert "AutoencoderKLWan" in title and "EXACT-CHUNKABLE" in title and "PASS" in title
    assert "latent frame" in texts and any("relL2 per latent frame" in t for t in texts)
    assert {"1e-8", "1e-4", "1e0"} <= set(texts)  # y ticks
    for name in ("library", "chunk-4", "exact"):
        assert f"{name} (pass)" in texts
    assert "library chunk start" in texts  # 17 frames in 1 + 4 + 4 + ... chunks: boundaries are marked
    title_band = image.crop((0, 0, 600, 24)).convert("L")
    assert title_band.getextrema()[0] < 100  # dark text pixels in the title band


def test_latent_boundaries_follow_the_causal_plan():
    assert latent_boundaries([9, 8, 8], 8) == [2, 3]
    assert latent_boundaries([1, 4, 4, 4, 4], 4) == [1, 2, 3, 4]
    assert latent_boundaries([17], 8) == []


def test_weights_are_named_for_what_they_are(wan_report):
    """The embedded VAE is trained: it must not be called a random-weight model."""
    assert weights_kind("default") == "trained-embedded"
    assert weights_kind("wan-tiny") == "random" and weights_kind("/models/vae") == "user"
    for kind, says, never in (
        ("trained-embedded", "trained", "random-weight"),
        ("random", "random-weight", "embedded"),
    ):
        report = dataclasses.replace(wan_report, vae={**wan_report.vae, "weights": kind})
        console = Console(record=True, width=200, force_terminal=False)
        render(report, console)
        first = console.export_text().splitlines()[0]
        assert says in first and never not in first


@pytest.mark.slow
def test_exact_chunkable_model_with_tile_blending_library_is_judged_approximate():
    """LTX: every norm is channel-only (EXACT-CHUNKABLE) but its chunked encode blends overlapping tiles
    without a conv cache; its rows are judged as approximate and the report says why."""
    ltx, wan = SimpleNamespace(family="ltx"), SimpleNamespace(family="wan")
    assert tolerance_class("framewise", EXACT, ltx)[0] == "approximate"
    assert tolerance_class("framewise", EXACT, wan) == ("exact", None)
    assert tolerance_class("exact", EXACT, ltx) == ("exact", None)
    assert tolerance_class("framewise", STATS, wan) == ("approximate", None)
    r = run_verify(
        load_config(
            flags={**SMALL, "verify.vae": "ltx-tiny", "verify.memory": False, "verify.dtypes": ["fp32"]}
        )
    )
    assert r.audit["verdict"] == EXACT
    assert all(p.tolerance_class == "approximate" for p in r.paths if p.available)
    assert any("judged as approximate" in n and "without a causal-conv cache" in n for n in r.notes)


def test_chunk_sizes_are_reported_as_run(tmp_path):
    """The causal VAE chunks in multiples of 8: asking for 4 runs 8-frame chunks, and the report says so;
    the library row shows the chunks the library really ran (16 + 1 frames by default)."""
    flags = {
        **SMALL,
        "verify.vae": "causal-vae-tiny",
        "verify.chunk_sizes": [4, 8],
        "verify.memory": False,
        "verify.decode": False,
        "verify.dtypes": ["fp32"],
    }
    steps: list[tuple[str, int, int | None]] = []
    r = run_verify(load_config(flags=flags), lambda step, done, total: steps.append((step, done, total)))
    assert [p.name for p in r.paths] == ["library", "chunk-8", "exact"]
    assert r.path("chunk-8").requested_chunk_frames == [4, 8]
    assert r.path("chunk-8").chunk_plan == [9, 8] and r.path("library").chunk_plan == [17]
    assert any("chunk size 4 ran as 8 frames" in n for n in r.notes)
    # progress: one step per path, counted up to a known total
    started = [s for s, _, _ in steps]
    assert [s.split(":")[0] for s in started if s.startswith("path")] == [
        "path library",
        "path chunk-8",
        "path exact",
    ]
    assert [d for _, d, _ in steps] == list(range(len(steps)))
    assert steps[-1] == ("done", steps[-1][2], steps[-1][2])


def test_bf16_copy_does_not_warn_about_fp32_modules():
    """diffusers' ModelMixin.to warns on every dtype cast ('should be kept in float32: []')."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("diffusers")
    handler = Collect(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        clone = bf16_copy(load_diffusers_vae("wan-tiny"))
    finally:
        logger.removeHandler(handler)
    assert next(clone.module.parameters()).dtype == torch.bfloat16
    assert not [r for r in records if "float32" in r.getMessage()]
