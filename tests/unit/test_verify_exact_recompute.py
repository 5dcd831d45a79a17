"""Exact chunked encode, recompute schedule: passes from a checkpoint reproduce the one-call encode on the
tiny CogVideoX and HunyuanVideo VAEs, at no more live memory than the library's framewise path."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from helpers.tolerance import assert_rounding_close
from pfctl.errors import ConfigError
from pfctl.models.diffusers_vae import load_diffusers_vae
from pfctl.models.exact_chunked import exact_chunked_encode
from pfctl.models.exact_recompute import exact_recompute_encode
from pfctl.verify.synthetic import synthetic_clip

MODELS = ["cogvideox-tiny", "hunyuan-tiny"]
# the longest sum in the tiny encoders: a 3x3x3 conv over 8 channels; about 20 of them chained
REDUCTION, DEPTH = 8 * 27, 20


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages that operators allocate under the mode and that are alive at the
    same time (a storage counts once, until it is freed). Deterministic: the same on any CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func._schema.is_mutable):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    key, nbytes = id(storage), storage.nbytes()
                    if key in self.seen or nbytes == 0:
                        continue
                    self.seen.add(key)
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, nbytes)
        return out


def _live_peak(fn) -> int:
    with torch.no_grad(), LiveBytes() as probe:
        fn()
    return probe.peak


@pytest.fixture(scope="module")
def clip():
    return synthetic_clip(17, 16, 16).video


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("checkpoint_bytes", [None, 0])
@pytest.mark.parametrize("chunk_frames", [4, 8])
def test_recompute_matches_one_call(name, clip, checkpoint_bytes, chunk_frames):
    vae = load_diffusers_vae(name)
    ref = vae.encode_moments(clip)
    plan = vae.chunk_plan(clip.shape[2], chunk_frames)
    assert len(plan) >= 2
    res = exact_recompute_encode(vae, clip, plan, checkpoint_bytes=checkpoint_bytes)
    assert_rounding_close(res.moments, ref, reduction=REDUCTION, depth=DEPTH)
    # the library's own chunked path is not exact on these VAEs: the comparison has teeth
    library = vae.encode_moments(clip, chunking="framewise", chunk_frames=chunk_frames)
    assert float((library - ref).norm() / ref.norm()) > 1e-3
    # one pass per time-coupled norm and the last one; a checkpoint is kept only within the budget
    assert res.num_passes == res.num_reductions + 1
    assert (res.peak_checkpoint_bytes == 0) == (checkpoint_bytes == 0)
    assert all("forward" not in m.__dict__ for m in vae.module.modules())  # patches undone


def test_recompute_reduces_once_per_time_coupled_norm_like_the_parked_schedule(clip):
    cog = load_diffusers_vae("cogvideox-tiny")
    plan = [5, 4, 4, 4]
    recompute = exact_recompute_encode(cog, clip, plan)
    parked = exact_chunked_encode(cog, clip, plan)
    assert recompute.num_reductions == parked.num_barriers == 13
    assert_rounding_close(recompute.moments, parked.moments, reduction=REDUCTION, depth=DEPTH)


def test_schedule_setting_picks_the_engine(clip, monkeypatch):
    from pfctl.models import exact_chunked, exact_recompute

    used: list[str] = []
    for mod, fn in ((exact_recompute, "exact_recompute_encode"), (exact_chunked, "exact_chunked_encode")):
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, _r=real, _n=fn, **k: used.append(_n) or _r(*a, **k))
    cog = load_diffusers_vae("cogvideox-tiny")
    assert cog.exact_schedule == "recompute"
    default = cog.encode_moments(clip, chunking="exact", chunk_frames=4)
    cog.exact_schedule = "parked"
    parked = cog.encode_moments(clip, chunking="exact", chunk_frames=4)
    assert used == ["exact_recompute_encode", "exact_chunked_encode"]
    assert_rounding_close(default, parked, reduction=REDUCTION, depth=DEPTH)
    with pytest.raises(ConfigError, match="parked"):
        load_diffusers_vae("hunyuan-tiny").encode_moments(clip, chunking="exact", schedule="parked")
    with pytest.raises(ConfigError, match="recompute, parked"):
        cog.encode_moments(clip, chunking="exact", schedule="fast")


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_recompute_peak_is_below_the_framewise_path(name):
    """Live tensor bytes over the encode of a clip of eight 4-frame chunks, against the library's
    framewise path with its 8-frame chunks. The tiny models' working set is only a few activations of a
    chunk, so a whole-clip checkpoint (the default, no limit) is about the framewise peak here (measured
    1.0-1.2x); with a budget of two chunks' activations it stays well under it (measured ~0.8x) and
    without checkpoints lower still (~0.6x). The one-call encode needs ~2.5-3x."""
    vae = load_diffusers_vae(name)
    x = synthetic_clip(33, 32, 32).video
    framewise = _live_peak(lambda: vae.encode_moments(x, chunking="framewise", chunk_frames=8))
    one_call = _live_peak(lambda: vae.encode_moments(x))
    plan = vae.exact_plan(33)
    assert plan == [5] + [4] * 7  # the recompute schedule's default: the smallest aligned chunks
    chunk_activation = 8 * 5 * 32 * 32 * 4  # the first chunk after conv_in: 8 channels, fp32
    budget = _live_peak(lambda: exact_recompute_encode(vae, x, plan, checkpoint_bytes=2 * chunk_activation))
    no_checkpoint = _live_peak(lambda: exact_recompute_encode(vae, x, plan, checkpoint_bytes=0))
    unlimited = _live_peak(lambda: exact_recompute_encode(vae, x, plan))
    assert framewise < one_call
    assert no_checkpoint < budget <= 0.9 * framewise
    assert budget < unlimited < 1.5 * framewise


@pytest.mark.slow
def test_real_cogvideox_default_is_below_framewise_on_the_meta_device():
    """The default schedule on the real CogVideoX config (215.6 M parameters, shapes only: the meta
    device allocates nothing) at 25x240x360 bf16: the live bytes its tensors would hold peak below the
    library framewise path's, with ~1.5x its convolution FLOPs (measured here: peak 0.62x, FLOPs 1.48x)."""
    from diffusers import AutoencoderKLCogVideoX
    from torch.utils.flop_counter import FlopCounterMode

    from pfctl.models.diffusers_vae import DiffusersVideoVAE

    with torch.device("meta"):
        module = AutoencoderKLCogVideoX().to(torch.bfloat16).eval()
    vae = DiffusersVideoVAE(module, spec="AutoencoderKLCogVideoX", is_demo=False)
    x = torch.empty(1, 3, 25, 240, 360, device="meta", dtype=torch.bfloat16)
    peaks, flops = {}, {}
    for name, kw in (("framewise", {"chunking": "framewise"}), ("exact", {"chunking": "exact"})):
        with torch.no_grad(), LiveBytes() as probe, FlopCounterMode(display=False) as counter:
            vae.encode_moments(x, **kw)
        peaks[name], flops[name] = probe.peak, counter.get_total_flops()
    assert peaks["exact"] <= peaks["framewise"]
    assert 1.3 <= flops["exact"] / flops["framewise"] <= 1.6
