"""pfctl model package: pyramid DiTs (miniFLUX, SD3-style MMDiT), the causal video VAE, VAE adapters,
text encoders and checkpoint loading.

Kept import-free on purpose: import the submodule you need (``pfctl.models.dit_flux`` ...), so that
``import pfctl.models`` never pulls torch or diffusers.
"""
