"""pfctl model package: pyramid DiTs (miniFLUX, SD3-style MMDiT), the causal video VAE, VAE adapters,
text encoders and checkpoint loading, in plain PyTorch as the reference computes them. The speed paths
(fused kernels, compiled blocks, activation checkpointing, CUDA graphs) are a separate layer applied to a
built model: :mod:`pfctl.models.fast`.

Kept import-free on purpose: import the submodule you need (``pfctl.models.dit_flux`` ...), so that
``import pfctl.models`` never pulls torch or diffusers.
"""
