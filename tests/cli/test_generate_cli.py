"""`pfctl generate`: option → config mapping, length conversions, prompt files, errors → exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from pfctl import api
from pfctl.cli.app import app
from pfctl.config.generate import PromptSpec, frames_for_temp, temp_for_duration, temp_for_frames

runner = CliRunner()


@pytest.fixture
def calls(monkeypatch):
    """Replace the library call; record what the CLI passed."""
    recorded: list[dict] = []

    def fake_generate(config, prompts=None, *, image=None, **options):
        recorded.append({"config": config, "prompts": prompts, "image": image, "options": options})
        video = SimpleNamespace(path=Path("out/x.mp4"), num_frames=17, width=64, height=64, seed=1)
        return SimpleNamespace(videos=[video])

    monkeypatch.setattr(api, "generate", fake_generate)
    return recorded


def invoke(*args: str):
    return runner.invoke(app, ["generate", *args], prog_name="pfctl")


def test_help_lists_the_options():
    result = invoke("--help")
    assert result.exit_code == 0
    for option in (
        "--prompts",
        "--image",
        "--temp",
        "--frames",
        "--duration",
        "--seed",
        "--num-videos",
        "--model",
        "--output-dir",
    ):
        assert option in result.output


def test_flags_reach_the_config(calls, tmp_path):
    result = invoke(
        "a red circle moving left",
        "--seed", "7",
        "--num-videos", "2",
        "-m", str(tmp_path),
        "-o", str(tmp_path / "out"),
        "--image", "img.png",
        "--set", "generate.guidance_scale=9",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (call,) = calls
    config = call["config"]
    assert config.generate.seed == 7 and config.generate.num_videos == 2
    assert config.model.path == str(tmp_path) and config.generate.output_dir == str(tmp_path / "out")
    assert config.generate.guidance_scale == 9
    assert call["prompts"] == [PromptSpec(prompt="a red circle moving left")]
    assert call["image"] == "img.png"
    assert "x.mp4" in result.output


def test_empty_prompt_is_allowed(calls):
    result = invoke("")
    assert result.exit_code == 0, result.output
    assert calls[0]["prompts"] == [PromptSpec(prompt="")]


@pytest.mark.parametrize(
    "args, temp, said",
    [
        (["--temp", "16"], 16, "121 frames"),
        (["--frames", "121"], 16, "121 frames → temp 16"),
        (["--frames", "100"], 13, "using 97 frames (temp 13"),
        (["--frames", "1"], 1, "temp 1"),
        (["--duration", "5"], 16, "121 frames (temp 16"),
        (["--duration", "10"], 31, "241 frames (temp 31"),
    ],
)
def test_length_conversions_say_what_they_chose(calls, args, temp, said):
    result = invoke("p", *args)
    assert result.exit_code == 0, result.output
    assert calls[0]["config"].generate.temp == temp
    assert said in result.output


def test_conversion_helpers():
    assert [frames_for_temp(t) for t in (1, 2, 16, 31)] == [1, 9, 121, 241]
    for frames in range(1, 300):
        temp, got = temp_for_frames(frames)
        assert got == frames_for_temp(temp) and abs(got - frames) <= 4
        if (frames - 1) % 8 == 0:
            assert got == frames
    assert temp_for_duration(5, 24) == (16, 121)


@pytest.mark.parametrize(
    "args, message",
    [
        (["p", "--temp", "0"], "--temp 0 is not valid"),
        (["p", "--frames", "0"], "--frames 0"),
        (["p", "--duration", "-1"], "--duration -1"),
        (["p", "--temp", "3", "--frames", "17"], "give only one of"),
        ([], "nothing to generate"),
        (["--set", "generate.temp=0"], "generate.temp"),
        (["p", "--set", "generate.decode_tile=48"], "multiple of 32"),
        (["p", "--set", "generate.num_inference_steps=[20,20]"], "3 positive step counts"),
        (["p", "--set", "generate.width=640"], "both generate.height and generate.width"),
    ],
)
def test_bad_options_exit_2_with_a_message(calls, args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert calls == []


def test_prompt_and_prompts_file_conflict(calls, tmp_path):
    file = tmp_path / "p.txt"
    file.write_text("a\n")
    result = invoke("x", "--prompts", str(file))
    assert result.exit_code == 2 and "not both" in result.output


def test_prompts_file_plain_text(calls, tmp_path):
    file = tmp_path / "p.txt"
    file.write_text("a red circle moving left\n\n# a comment\na blue square moving up\n")
    result = invoke("--prompts", str(file))
    assert result.exit_code == 0, result.output
    prompts = calls[0]["prompts"]
    assert [p.prompt for p in prompts] == ["a red circle moving left", "a blue square moving up"]
    assert prompts[1].source == f"{file}:4"


def test_prompts_file_jsonl_overrides(calls, tmp_path):
    file = tmp_path / "p.jsonl"
    rows = [
        {"prompt": "a red circle moving left", "seed": 3, "temp": 2, "guidance": 8.5},
        {
            "text": "a green square moving up",
            "video_guidance_scale": 4,
            "image": "first.png",
            "num_videos": 2,
        },
    ]
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = invoke("--prompts", str(file))
    assert result.exit_code == 0, result.output
    a, b = calls[0]["prompts"]
    assert (a.prompt, a.seed, a.temp, a.guidance_scale) == ("a red circle moving left", 3, 2, 8.5)
    assert (b.prompt, b.video_guidance_scale, b.num_videos) == ("a green square moving up", 4, 2)
    assert b.image == str(tmp_path / "first.png")  # relative to the prompts file


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": "a", "sede": 3}\n', "unknown key 'sede'"),
        ('{"prompt": "a", "temp": 0}\n', "temp = 0 is not valid"),
        ('{"prompt": "a", "seed": "x"}\n', "seed = 'x'"),
        ('{"prompt": "a"}\n{broken\n', ":2: not valid JSON"),
        ('{"seed": 1}\n', "needs a string 'prompt'"),
        ("\n\n", "has no prompts"),
    ],
)
def test_bad_prompts_files_exit_2(calls, tmp_path, content, message):
    file = tmp_path / "p.jsonl"
    file.write_text(content)
    result = invoke("--prompts", str(file))
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert calls == []


def test_missing_prompts_file_exit_2(calls, tmp_path):
    result = invoke("--prompts", str(tmp_path / "nope.txt"))
    assert result.exit_code == 2 and "does not exist" in result.output


def test_print_config_shows_the_chosen_temp(calls):
    result = invoke("--frames", "25", "--print-config")
    assert result.exit_code == 0, result.output
    assert "temp: 4" in result.output and calls == []


# -- real library errors (no model needed: inputs are checked before any model is loaded) --------


def test_unreadable_image_exit_2_nothing_written(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"garbage")
    out = tmp_path / "out"
    result = invoke("p", "--image", str(bad), "-m", str(tmp_path), "-o", str(out))
    assert result.exit_code == 2, result.output
    assert "cannot read image" in result.output
    assert not out.exists()


def test_output_folder_not_writable_exit_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = invoke("p", "-m", str(tmp_path), "-o", str(blocker / "sub"))
    assert result.exit_code == 2, result.output
    assert "not writable" in result.output


def test_unknown_model_folder_exit_2(tmp_path):
    out = tmp_path / "out"
    result = invoke("p", "-m", str(tmp_path / "no-such-model"), "-o", str(out))
    assert result.exit_code == 2, result.output
    assert "does not exist" in result.output and "no-such-model" in result.output
    assert list(out.iterdir()) == []
