"""``generate.low_memory``: every level makes the default path's video on the CPU (the same ops on the same
tensors: bit-equal), block swap keeps the model's keys and holds at most two blocks on the device, and the
expected peak is the sum its docstring states."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from helpers.tiny_models import FAST_GENERATE
from pfctl.config import load_config
from pfctl.sampling.generate import run_generate
from pfctl.sampling.memory import MemoryParts, dit_tokens, expected_peak_bytes

FAST = [*FAST_GENERATE, "generate.temp=2", "generate.seed=3"]


@pytest.mark.slow
def test_every_level_makes_the_default_video(model_dir, runtime, tmp_path):
    videos = {}
    for level in ("none", "offload", "stream", "offload-flag"):
        setting = "generate.offload=true" if level == "offload-flag" else f"generate.low_memory={level}"
        out = tmp_path / level
        config = load_config(None, [f"model.path={model_dir}", f"generate.output_dir={out}", *FAST, setting])
        (video,) = run_generate(config, ["a red circle"], runtime=runtime, keep_latents=True).videos
        videos[level] = video
        sidecar = json.loads(video.sidecar.read_text())
        memory = sidecar["runtime"]["memory"]
        assert memory["low_memory"] == ("offload" if level == "offload-flag" else level)
        assert memory["expected_peak_bytes"] > 0
    base = videos["none"]
    for level, video in videos.items():
        assert torch.equal(video.latents, base.latents), level
        assert video.path.read_bytes() == base.path.read_bytes(), level  # x264 on one thread: same bytes


def test_a_bad_level_is_refused_naming_the_key_and_the_levels():
    from pfctl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"generate\.low_memory.*'none', 'offload' or 'stream'"):
        load_config(None, ["generate.low_memory=tiny"])


class _Blocks(nn.Module):
    """A stand-in DiT: an input layer, three blocks, an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.out = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def blocks_in_order(self) -> list[tuple[str, nn.Module]]:
        return [(f"blocks.{i}", b) for i, b in enumerate(self.blocks)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x) * self.scale


def test_block_swap_streams_one_block_at_a_time_and_keeps_the_keys():
    from pfctl.models.block_swap import BlockSwap

    model = _Blocks()
    keys = list(model.state_dict())
    swap = BlockSwap(model).to("cpu")
    seen: list[list[int]] = []
    for block in model.blocks:  # after the swap's own pre-hook: what the block computes with
        block.register_forward_pre_hook(lambda *_: seen.append(swap.on_device))
    with torch.no_grad():
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    # block i computes with block i + 1 arriving; the one before has left; none stays after the forward
    assert seen == [[0, 1], [1, 2], [2]] * 2
    assert swap.on_device == []
    assert list(model.state_dict()) == keys
    swap.remove()
    model(torch.randn(2, 4))
    assert seen[6:] == [[], [], []]  # the swap's hooks are off: nothing is fetched


def test_block_swap_on_the_cpu_runs_the_same_ops():
    from pfctl.models.block_swap import BlockSwap

    model = _Blocks()
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = model(x)
        BlockSwap(model).to("cpu")
        assert torch.equal(model(x), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="moves parts to a CUDA device")
def test_parked_parts_go_back_to_their_host_tensors_without_a_copy():
    from pfctl.models.block_swap import Parked

    model = _Blocks()
    model.out.weight = model.embed.weight  # a tied weight moves once and stays tied
    x = torch.randn(2, 4)
    with torch.no_grad():
        expected = model(x)
    parked = Parked(model).to("cuda")
    assert all(t.is_cuda for t in [*model.parameters(), *model.buffers()])
    assert model.out.weight is model.embed.weight
    with torch.no_grad():
        got = model(x.cuda()).cpu()
    torch.testing.assert_close(got, expected)  # a GPU's matmul: fp32 rounding, not bits
    parked.to("cpu")
    tensors = [*model.parameters(), *model.buffers()]
    assert all(t.device.type == "cpu" and t.is_pinned() for t in tensors)
    host = [t.data_ptr() for t in tensors]
    parked.to("cuda")
    parked.to("cpu")  # back to the same pinned host tensors: the only copy is the upload
    assert [t.data_ptr() for t in [*model.parameters(), *model.buffers()]] == host


def test_the_text_encoders_stream_their_t5_layers_and_encode_the_same(text_folder):
    from pfctl.models.block_swap import BlockSwap, Streamed, streamed_blocks
    from pfctl.models.text_encoder import load_text_encoder
    from pfctl.sampling.memory import measure_parts

    encoder = load_text_encoder(text_folder, model_name="pyramid_flux", dtype=torch.float32, device="cpu")
    expected = encoder.encode(["a red circle moving right"])
    layers = [b for m in encoder.modules() for b in streamed_blocks(m)]
    assert layers and all(type(b).__name__ == "T5Block" for b in layers)
    part = Streamed(encoder).to("cpu")
    (swap,) = [p for p in part.parts if isinstance(p, BlockSwap)]
    seen: list[list[int]] = []
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: seen.append(swap.on_device))
    got = encoder.encode(["a red circle moving right"])
    assert seen == [[i, i + 1] for i in range(len(layers) - 1)] + [[len(layers) - 1]]
    assert torch.equal(got.prompt_embeds, expected.prompt_embeds)
    assert torch.equal(got.pooled_prompt_embeds, expected.pooled_prompt_embeds)
    dit = _Blocks()
    dit.inner_dim = 4
    parts = measure_parts(encoder, dit, nn.Conv2d(1, 1, 1), torch.float32)
    layer_bytes = [sum(t.numel() * 4 for t in b.parameters()) for b in layers]
    assert (parts.text_blocks, parts.text_block) == (sum(layer_bytes), max(layer_bytes))


def test_expected_peak_adds_what_each_phase_holds():
    parts = MemoryParts(
        text=1000, dit=500, dit_blocks=400, dit_block=100, vae=50, dit_width=8, dtype_bytes=2, text_blocks=900,
        text_block=300,
    )  # fmt: skip
    tokens, rows = 16, 2
    act = rows * tokens * 8 * 2 * 12 + rows * tokens * tokens * 2
    untiled = (19_000 + 12_500) * 64 * 64 * 2 // 2
    tiled = (19_000 + 12_500) * 32 * 32 * 2 // 2
    common = {"tokens": tokens, "rows": rows, "height": 64, "width": 64}
    assert expected_peak_bytes("none", parts, tile=None, **common) == 1000 + 500 + 50 + max(act, untiled)
    text = 1000 - 900 + 2 * 300  # the T5 layers stream: two on the device at a time
    assert expected_peak_bytes("offload", parts, tile=32, **common) == max(text, 500 + act, 50 + tiled)
    stream = max(text, 500 - 400 + 2 * 100 + act, 50 + tiled)
    assert expected_peak_bytes("stream", parts, tile=32, **common) == stream


def test_measure_parts_counts_every_part_and_the_blocks():
    from pfctl.sampling.memory import measure_parts

    class Text:  # the text encoders are no nn.Module: they expose parameters()
        def __init__(self) -> None:
            self.t5 = nn.Linear(10, 10)

        def parameters(self):
            return self.t5.parameters()

    dit, vae = _Blocks(), nn.Conv2d(1, 1, 1)
    dit.inner_dim = 4
    parts = measure_parts(Text(), dit, vae, torch.bfloat16)
    block = (16 + 4) * 4
    assert parts.text == 110 * 4 and parts.vae == 2 * 4
    assert (parts.dit, parts.dit_blocks, parts.dit_block) == (5 * block + 4 * 4, 3 * block, block)
    assert (parts.dit_width, parts.dtype_bytes) == (4, 2)


def test_dit_tokens_counts_the_last_unit_and_its_history():
    # one frame: the full-resolution clip only, 2x2 patches
    assert dit_tokens(1, 16, 16) == 8 * 8
    # two frames: the newest history unit at full resolution too
    assert dit_tokens(2, 16, 16) == 2 * 8 * 8
    # three: + one unit at the middle stage (8x8 latents → 4x4 tokens)
    assert dit_tokens(3, 16, 16) == 2 * 8 * 8 + 4 * 4
