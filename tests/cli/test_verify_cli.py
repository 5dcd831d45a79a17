"""`pfctl verify-groupnorm`: flags map to verify.* config, exit codes 0 / 1 / 2."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from pfctl.cli.app import app

SMALL = ["--frames", "9", "--size", "16x16", "--chunk-sizes", "4", "--set", "verify.memory=false"]
runner = CliRunner()


def _invoke(args):
    return runner.invoke(app, ["verify-groupnorm", *args], prog_name="pfctl")


def test_print_config_maps_flags():
    res = _invoke(
        [
            "--vae",
            "wan-tiny",
            "--frames",
            "25",
            "--size",
            "32x16",
            "--chunk-sizes",
            "4,8",
            "--json",
            "r.json",
            "--plot",
            "p.png",
            "--tol",
            "exact_rel_l2=1e-4",
            "--fps",
            "12",
            "--print-config",
        ]
    )
    assert res.exit_code == 0, res.output
    v = yaml.safe_load(res.output)["verify"]
    assert v["vae"] == "wan-tiny" and v["num_frames"] == 25
    assert (v["width"], v["height"]) == (32, 16)
    assert v["chunk_sizes"] == [4, 8] and v["fps"] == 12
    assert v["json_path"] == "r.json" and v["plot_path"] == "p.png"
    assert v["tolerances"]["exact_rel_l2"] == 1e-4


def test_exit_0_on_exact_chunkable_vae(tmp_path):
    out = tmp_path / "r.json"
    res = _invoke(["--vae", "wan-tiny", *SMALL, "--set", "verify.dtypes=[fp32]", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "EXACT-CHUNKABLE" in res.output and "demonstration of the algebra" in res.output
    data = json.loads(out.read_text())
    assert data["status"] == "pass" and data["exit_code"] == 0


def test_exit_1_when_chunked_path_fails(tmp_path):
    res = _invoke(
        [
            "--vae",
            "cogvideox-tiny",
            *SMALL,
            "--set",
            "verify.dtypes=[fp32]",
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    assert res.exit_code == 1, res.output
    assert "STATS-COUPLED" in res.output and "FAIL" in res.output
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")


def test_tolerance_override_turns_fail_into_pass():
    res = _invoke(
        [
            "--vae",
            "cogvideox-tiny",
            *SMALL,
            "--set",
            "verify.dtypes=[fp32]",
            "--set",
            "verify.decode=false",
            "--tol",
            "approx_rel_l2_pass=10",
            "--tol",
            "drift_warn=100",
        ]
    )
    assert res.exit_code == 0, res.output


def test_exit_2_on_usage_errors(tmp_path):
    assert _invoke(["--size", "big"]).exit_code == 2
    assert _invoke(["--chunk-sizes", "4,x"]).exit_code == 2
    assert _invoke(["--tol", "no_such_key=1"]).exit_code == 2
    assert _invoke(["--vae", str(tmp_path / "missing")]).exit_code == 2
    assert _invoke(["--vae", "wan-tiny", "--video", str(tmp_path / "none.mp4"), *SMALL]).exit_code == 2
    assert _invoke(["--frames", "0"]).exit_code == 2


def test_exact_offload_budget_gives_the_same_exact_encode(tmp_path):
    """verify.exact_offload_above_gib=0 parks every norm input in host memory: same exact path numbers."""
    runs = {}
    parked = ["--set", "verify.exact_schedule=parked"]
    for name, extra in (("gpu", parked), ("offload", [*parked, "--set", "verify.exact_offload_above_gib=0"])):
        out = tmp_path / f"{name}.json"
        res = _invoke(
            ["--vae", "cogvideox-tiny", *SMALL, "--set", "verify.dtypes=[fp32]", *extra, "--json", str(out)]
        )
        assert res.exit_code == 1, res.output  # the library's chunked path fails; the exact one must not
        runs[name] = next(p for p in json.loads(out.read_text())["paths"] if p["name"] == "exact")
    assert runs["offload"]["status"] == "pass"
    assert runs["offload"] == runs["gpu"]


@pytest.mark.slow
def test_small_odd_sized_video_runs_and_progress_goes_to_stderr(tmp_path):
    """A 72x48 clip (decord mis-sizes it) is read as encode-latents reads it; each step is announced on
    stderr, and stdout keeps only the report."""
    pytest.importorskip("decord")
    from pfctl.data.synthetic import moving_frames, write_video

    video = write_video(tmp_path / "small.mp4", moving_frames(12, 48, 72), fps=25)
    out = tmp_path / "r.json"
    res = CliRunner().invoke(
        app,
        ["verify-groupnorm", "--vae", "wan-tiny", "--video", str(video), *SMALL, "--json", str(out)],
        prog_name="pfctl",
    )
    assert res.exit_code == 0, res.output
    assert "path library" in res.stderr and "path exact" in res.stderr
    assert "path library" not in res.stdout and "EXACT-CHUNKABLE" in res.stdout
    assert json.loads(out.read_text())["input"]["source"] == str(video)
