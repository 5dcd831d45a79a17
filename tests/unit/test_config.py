"""Recipe loading: YAML → --set → flags → validated config, and its error messages."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pfctl.config import dump_config, load_config, parse_override
from pfctl.config.load import RECIPES_DIR, available_recipes
from pfctl.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "path", "value"),
    [
        ("train.lr=1e-4", ["train", "lr"], 1e-4),
        ("runtime.seed=3", ["runtime", "seed"], 3),
        ("model.path=/data/pyramid flow", ["model", "path"], "/data/pyramid flow"),
        ("a.b=[1, 2]", ["a", "b"], [1, 2]),
        ("a.b=true", ["a", "b"], True),
        ("a.b=", ["a", "b"], None),
        ("a.b=x=y", ["a", "b"], "x=y"),
    ],
)
def test_parse_override(text: str, path: list[str], value: object) -> None:
    assert parse_override(text) == (path, value)


@pytest.mark.parametrize("text", ["novalue", "=3", "a..b=1", ".a=1"])
def test_bad_override_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="bad override"):
        parse_override(text)


def test_precedence_defaults_recipe_set_flags(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("runtime:\n  seed: 1\n  device: cpu\n")
    assert load_config().runtime.seed == 42
    assert load_config(str(recipe)).runtime.seed == 1
    assert load_config(str(recipe), ["runtime.seed=2"]).runtime.seed == 2
    cfg = load_config(str(recipe), ["runtime.seed=2"], {"runtime.seed": 3, "runtime.log_format": None})
    assert cfg.runtime.seed == 3 and cfg.runtime.device == "cpu" and cfg.runtime.log_format == "auto"


def test_unknown_key_names_key_and_suggests(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["runtime.sed=1"])
    assert "runtime.sed" in info.value.message and "runtime.seed" in (info.value.hint or "")


def test_bad_value_names_key_value_and_allowed() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["runtime.mixed_precision=fp8"])
    text = str(info.value)
    assert "runtime.mixed_precision" in text and "'fp8'" in text and "'bf16'" in text


def test_wrong_type_is_named() -> None:
    with pytest.raises(ConfigError, match=r"runtime\.seed = 'abc'"):
        load_config(None, ["runtime.seed=abc"])


def test_recipe_must_be_a_mapping(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(str(bad))
    bad.write_text("runtime: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


def test_yaml_is_loaded_safely(tmp_path: Path) -> None:
    evil = tmp_path / "evil.yaml"
    evil.write_text("description: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(evil))


def test_config_is_frozen() -> None:
    cfg = load_config()
    with pytest.raises(Exception):  # noqa: B017 - pydantic raises ValidationError on assignment
        cfg.runtime.seed = 5  # type: ignore[misc]


def test_dump_then_load_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, ["runtime.seed=9"])
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize("name", available_recipes())
def test_every_shipped_recipe_loads(name: str) -> None:
    cfg = load_config(name)
    assert cfg == load_config(str(RECIPES_DIR / f"{name}.yaml"))
    raw = yaml.safe_load((RECIPES_DIR / f"{name}.yaml").read_text())
    assert isinstance(raw, dict) and raw.get("description"), "every recipe says what it is for"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["train.cuda_graphs=true", "train.compile=false"], ["train.compile=false"]),
        (
            ["train.cuda_graphs=true", "train.compile=true", "train.gradient_checkpointing=true"],
            ["train.gradient_checkpointing=true"],
        ),
        (
            ["train.cuda_graphs=true", "train.compile=false", "train.fsdp=full_shard"],
            ["train.compile=false", "train.fsdp=full_shard"],
        ),
    ],
)
def test_cuda_graphs_names_each_setting_it_cannot_work_with(overrides: list[str], named: list[str]) -> None:
    from pfctl.config.train import check_train_constraints

    train = load_config(None, overrides).train
    with pytest.raises(ConfigError) as info:
        check_train_constraints(train, 2)
    message = str(info.value).splitlines()[0]  # (the hint below it names every setting)
    assert all(key in message for key in named)
    assert message.count("train.") - message.count("train.cuda_graphs") == len(named)
    check_train_constraints(load_config(None, ["train.cuda_graphs=true", "train.compile=true"]).train, 1)
    check_train_constraints(load_config(None, ["train.cuda_graphs=true"]).train, 1)  # compile auto
    # FSDP over one process (no offload) shards nothing and is skipped: nothing to refuse
    check_train_constraints(load_config(None, ["train.cuda_graphs=true", "train.fsdp=full_shard"]).train, 1)


# (overrides, device, world) -> (compile, cuda_graphs, attention, fsdp): the defaults are the compiled
# blocks on CUDA, the eager ones on the CPU; the whole step's CUDA graphs by default on one CUDA process
# without checkpointing or host offload, the blocks' graphs only when asked for; cuDNN's attention only with
# graphs or row groups (skip_future_keys), the memory-efficient kernel otherwise
SPEED_CASES = [
    ([], "cuda", 1, (True, "step", "cudnn", "none")),
    ([], "cuda", 2, (True, False, "efficient", "none")),
    ([], "cpu", 2, (False, False, "efficient", "none")),
    (["train.compile=false"], "cuda", 1, (False, False, "efficient", "none")),
    (["train.gradient_checkpointing=true"], "cuda", 1, (True, False, "efficient", "none")),
    (["train.fsdp=shard_grad_op"], "cuda", 2, (True, False, "efficient", "shard_grad_op")),
    (["train.fsdp=shard_grad_op"], "cuda", 1, (True, "step", "cudnn", "none")),  # one process: nothing to shard
    (["train.grad_accum=2"], "cuda", 1, (True, "step", "cudnn", "none")),
    (["train.lora.enabled=true"], "cuda", 1, (True, "step", "cudnn", "none")),
    (["train.cuda_graphs=step", "train.gradient_checkpointing=true"], "cuda", 1, (True, "step", "cudnn", "none")),
    (["train.grad_accum=2", "train.cuda_graphs=true"], "cuda", 1, (True, True, "cudnn", "none")),
    (
        ["train.fsdp=full_shard", "train.fsdp_cpu_offload=true"],
        "cuda",
        1,
        (True, False, "efficient", "full_shard"),
    ),
    (["train.fsdp=full_shard"], "cpu", 1, (False, False, "efficient", "full_shard")),
    (["train.cuda_graphs=false"], "cuda", 1, (True, False, "efficient", "none")),
    (["train.skip_future_keys=true"], "cuda", 2, (True, False, "cudnn", "none")),
    (["train.cuda_graphs=true", "train.attention=efficient"], "cuda", 1, (True, True, "efficient", "none")),
    (["train.gradient_checkpointing=true", "train.skip_future_keys=true"], "cuda", 1, (True, False, "cudnn", "none")),
    (["train.compile=false", "train.skip_future_keys=true"], "cuda", 1, (False, False, "efficient", "none")),
    (["train.compile=true", "train.cuda_graphs=true"], "cpu", 1, (False, False, "efficient", "none")),
    # FlexAttention: kept on CUDA (row groups or not), the memory-efficient kernel on the CPU (no backward)
    (["train.attention=flex", "train.skip_future_keys=true"], "cuda", 2, (True, False, "flex", "none")),
    (["train.attention=flex"], "cuda", 1, (True, "step", "flex", "none")),
    (["train.attention=flex"], "cpu", 1, (False, False, "efficient", "none")),
]


@pytest.mark.parametrize(("overrides", "device", "world", "expected"), SPEED_CASES)
def test_speed_options_settle_per_device_and_world(
    overrides: list[str], device: str, world: int, expected: tuple
) -> None:
    from pfctl.config.train import resolve_train_speed

    train = load_config(None, overrides).train
    speed = resolve_train_speed(train, device, world)
    assert (speed.compile, speed.cuda_graphs, speed.attention, speed.fsdp) == expected
    assert ("compiled" in speed.describe()) == speed.compile
    assert ("checkpointing none" in speed.describe()) == (not train.gradient_checkpointing)


# (overrides, device, why the merged step does not fit the GPU) -> micro-batches merged (None: one a step):
# ``auto`` merges where the host sets the pace (compiled blocks without graphs) unless the run checkpoints
# (memory first) or the merged step does not fit; an explicit setting is kept, on the CPU too
ACCUM = "train.grad_accum=2"
MERGE_CASES = [
    ([ACCUM], "cuda", None, True),
    ([ACCUM], "cuda", "too big", False),
    ([ACCUM], "cpu", None, False),
    ([], "cuda", None, None),
    ([ACCUM, "train.cuda_graphs=true"], "cuda", None, False),
    ([ACCUM, "train.compile=false"], "cuda", None, False),
    ([ACCUM, "train.gradient_checkpointing=true"], "cuda", None, False),
    ([ACCUM, "train.fsdp=full_shard"], "cuda", None, True),
    ([ACCUM, "train.merge_micro_batches=true"], "cpu", None, True),
    ([ACCUM, "train.merge_micro_batches=true"], "cuda", "too big", True),
    ([ACCUM, "train.merge_micro_batches=false"], "cuda", None, False),
]


@pytest.mark.parametrize(("overrides", "device", "too_big", "expected"), MERGE_CASES)
def test_micro_batches_merge_where_the_host_sets_the_pace(
    overrides: list[str], device: str, too_big: str | None, expected: bool | None
) -> None:
    from pfctl.config.train import resolve_train_speed

    speed = resolve_train_speed(load_config(None, overrides).train, device, 2, None, too_big)
    assert speed.merge_micro_batches is expected
    line = speed.describe()
    assert ("micro-batches" in line) == (expected is not None)
    assert ("micro-batches merged" in line) == bool(expected)
    auto_declined = too_big is not None and "train.merge_micro_batches=true" not in overrides
    assert (f"micro-batches one by one: {too_big}" in line) == auto_declined


def test_speed_line_names_the_checkpointing() -> None:
    from pfctl.config.train import resolve_train_speed

    train = load_config("pyramid-flux-768p-8gpu").train
    assert "checkpointing 0.75 selective_narrow" in resolve_train_speed(train, "cuda", 8).describe()
    train = load_config(None, ["train.gradient_checkpointing=true", "train.gradient_checkpointing_policy=full"]).train
    assert "checkpointing 0.75 full" in resolve_train_speed(train, "cpu", 1).describe()


def test_without_a_compiler_auto_keeps_the_eager_blocks() -> None:
    """No Triton (``auto`` settles on eager blocks, and says why); an explicit ``true`` is kept (and then
    fails where torch.compile does, naming Triton)."""
    from pfctl.config.train import resolve_train_speed

    speed = resolve_train_speed(load_config(None).train, "cuda", 1, "Triton is not installed")
    assert (speed.compile, speed.cuda_graphs, speed.attention) == (False, False, "efficient")
    assert "Triton is not installed" in speed.describe()
    forced = load_config(None, ["train.compile=true"]).train
    assert resolve_train_speed(forced, "cuda", 1, "Triton is not installed").compile


@pytest.mark.parametrize("name", [n for n in available_recipes() if n.startswith("pyramid-flux")])
def test_shipped_gpu_recipes_compile_on_cuda_by_default(name: str) -> None:
    """Every shipped GPU recipe runs the compiled blocks on CUDA as users launch it (8 processes)."""
    from pfctl.config.train import resolve_train_speed

    assert resolve_train_speed(load_config(name).train, "cuda", 8).compile
