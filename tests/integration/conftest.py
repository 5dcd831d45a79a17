"""Fixtures the integration tests share: a tiny text-encoder folder and a CPU runtime (built once a session), a
tiny model folder in the official layout (once per module)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def text_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.tiny_models import make_text_encoder_folder

    return make_text_encoder_folder(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="session")
def runtime():
    from pfctl.config.schema import RuntimeConfig
    from pfctl.runtime.accelerator import build_runtime

    return build_runtime(RuntimeConfig(device="cpu"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers.tiny_models import make_official_folder

    return make_official_folder(tmp_path_factory.mktemp("models"))
