"""The report: stable JSON key set, judging against the tolerance table, PNG plot."""

from __future__ import annotations

import json
import struct
import zlib

import pytest

from pfctl.config import load_config
from pfctl.verify.report import (
    AUDIT_KEYS,
    PATH_KEYS,
    SCHEMA_VERSION,
    TOP_KEYS,
    plot_per_frame_error,
    png_bytes,
)
from pfctl.verify.run import run_verify, write_outputs

SMALL = {
    "verify.num_frames": 17,
    "verify.height": 16,
    "verify.width": 16,
    "verify.chunk_sizes": [4],
    "verify.memory": True,
}


@pytest.fixture(scope="module")
def cog_report():
    return run_verify(load_config(flags={**SMALL, "verify.vae": "cogvideox-tiny"}))


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
    assert r.vae["is_demo"] and any("demonstration of the algebra" in n for n in r.notes)
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


def test_png_is_valid(wan_report):
    data = plot_per_frame_error(wan_report, width=64, height=32)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    w, h = struct.unpack(">II", data[16:24])
    assert (w, h) == (64, 32)
    idat = data[data.index(b"IDAT") + 4 : data.index(b"IEND") - 8]
    assert len(zlib.decompress(idat)) == h * (1 + 3 * w)


def test_png_bytes_roundtrip():
    rows = [bytearray([255, 0, 0] * 2), bytearray([0, 255, 0] * 2)]
    data = png_bytes(rows, 2, 2)
    idat = data[data.index(b"IDAT") + 4 : data.index(b"IEND") - 8]
    assert zlib.decompress(idat) == b"\x00" + bytes(rows[0]) + b"\x00" + bytes(rows[1])
