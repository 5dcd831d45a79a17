"""The reference implementation (jy0205/Pyramid-Flow) made runnable beside pfctl, and what both sides of a
side-by-side share: the reference imported with its optional training-only dependencies stubbed, its block
noise drawn from a regularised covariance and recorded, one random-weight checkpoint folder in the official
layout that both load, random text features of the DiT's widths, and the timing and comparison helpers.
Used by ``bench_reference.py``, ``bench_train.py --reference``, ``bench_vae.py`` and
``check_official_export.py``; the reasons for the stubs and the jitter are in ``bench_reference.py``'s
docstring.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import json
import shutil
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_generate import RandomTextEncoder  # noqa: E402

OPTIONAL_REFERENCE_IMPORTS = ("tensorboardX", "IPython", "timm", "torchvision")
COVARIANCE_JITTER = 1e-6
PROMPT = "a red circle moving left"
VARIANT = "diffusion_transformer_384p"
CPU_DIT = {
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 64,  # the reference fixes axes_dims_rope = [16, 24, 24]
    "num_attention_heads": 2,
    "axes_dims_rope": [16, 24, 24],
}
TOLERANCE = {"cuda": 5e-2, "cpu": 1e-4}
"""Relative L2 error allowed between the two implementations' latents (bf16 on CUDA, fp32 on CPU)."""


# ----------------------------------------------------------------------------- the reference
class _StubModule(types.ModuleType):
    """Any attribute is another stub and calling one does nothing: enough for import-time
    ``from x import y`` and for ``timm``'s weight initialisers, whose values the loaded weights replace."""

    def __getattr__(self, name: str) -> _StubModule:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubModule(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs) -> None:
        return None


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module) -> None:
        module.__path__ = []


def import_reference(root: Path) -> tuple[type, list[str]]:
    """The reference's ``PyramidDiTForVideoGeneration`` and the modules that had to be stubbed."""
    if not (root / "pyramid_dit" / "pyramid_dit_for_video_gen_pipeline.py").is_file():
        raise SystemExit(
            f"error: {root} is not a Pyramid-Flow checkout (git clone jy0205/Pyramid-Flow there)"
        )
    import diffusers  # (probes torchvision at import: before any stub exists)
    import diffusers.models.modeling_utils  # noqa: F401
    import transformers  # noqa: F401

    missing = []
    for name in OPTIONAL_REFERENCE_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        sys.meta_path.insert(0, _StubFinder(set(missing)))
    sys.path.insert(0, str(root))
    pipeline = importlib.import_module("pyramid_dit")
    return pipeline.PyramidDiTForVideoGeneration, missing


class _JitteredNormal(torch.distributions.MultivariateNormal):
    def __init__(self, loc: torch.Tensor, covariance_matrix: torch.Tensor, **kwargs) -> None:
        eye = torch.eye(covariance_matrix.shape[-1], dtype=covariance_matrix.dtype)
        super().__init__(loc, covariance_matrix=covariance_matrix + COVARIANCE_JITTER * eye, **kwargs)


@contextlib.contextmanager
def reference_noise_recorder(pipe):
    """Run the reference with a regular block-noise covariance, recording every noise it draws."""
    record: dict = {"initial": None, "blocks": []}
    prepare, block = pipe.prepare_latents, pipe.sample_block_noise

    def prepare_latents(*args, **kwargs):
        record["initial"] = prepare(*args, **kwargs)
        return record["initial"]

    def sample_block_noise(*args, **kwargs):
        record["blocks"].append(block(*args, **kwargs))
        return record["blocks"][-1]

    mvn_module = torch.distributions.multivariate_normal
    original = mvn_module.MultivariateNormal
    pipe.prepare_latents, pipe.sample_block_noise = prepare_latents, sample_block_noise
    mvn_module.MultivariateNormal = _JitteredNormal
    try:
        yield record
    finally:
        mvn_module.MultivariateNormal = original
        del pipe.prepare_latents, pipe.sample_block_noise


# ----------------------------------------------------------------------------- shared set-up
def write_checkpoint(
    folder: Path, variant: str, dit_overrides: dict, vae_config: dict | None, seed: int, dtype: torch.dtype
) -> int:
    """A random-weight checkpoint folder in the official layout; returns the DiT's parameter count."""
    from pfctl.models.causal_vae import CausalVideoVAE
    from pfctl.models.registry import build_dit

    dit = build_dit("miniflux", dit_overrides, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in dit.parameters():  # a fresh DiT predicts exactly 0: give it a non-trivial output
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    torch.nn.Module.to(dit, dtype=dtype).save_pretrained(folder / VARIANT)
    if vae_config is not None:
        torch.manual_seed(seed)
        vae = torch.nn.Module.to(CausalVideoVAE(**vae_config), dtype=dtype)
        vae.save_pretrained(folder / "causal_video_vae")
    return sum(p.numel() for p in dit.parameters())


def prepare_checkpoint(
    device: torch.device, dtype: torch.dtype, vae_config: dict | None
) -> tuple[Path, int, RandomTextEncoder]:
    """A temporary checkpoint folder (removed at exit), the DiT's parameter count, and random text
    features of the DiT's widths: miniFLUX on CUDA, the small ``CPU_DIT`` on the CPU."""
    folder = Path(tempfile.mkdtemp(prefix="pfctl-bench-reference-"))
    atexit.register(shutil.rmtree, folder, True)
    dit_params = write_checkpoint(
        folder, VARIANT, {} if device.type == "cuda" else CPU_DIT, vae_config, 0, dtype
    )
    dit_config = json.loads((folder / VARIANT / "config.json").read_text())
    text = RandomTextEncoder(
        128, dit_config["joint_attention_dim"], dit_config["pooled_projection_dim"], device, dtype
    )
    return folder, dit_params, text


def open_reference(Reference: type, folder: Path, device: torch.device, **kwargs: object) -> object:
    """The reference pipeline on ``folder`` (miniFLUX layout, no text encoders: the harness feeds features)."""
    return Reference(
        str(folder),
        model_dtype="bf16" if device.type == "cuda" else "fp32",
        model_name="pyramid_flux",
        model_variant=VARIANT,
        load_text_encoder=False,
        **kwargs,
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def time_call(fn, device: torch.device):
    reset_peak(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0, peak_gib(device)


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (a fresh context each time: the reference nests one inside ours)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def gib(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
