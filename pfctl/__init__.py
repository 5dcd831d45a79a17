"""pfctl: train and run pyramidal-flow-matching video diffusion models.

Importing this package is cheap on purpose: heavy modules (torch, diffusers, accelerate,
transformers, decord, av) are imported inside the functions that need them.
"""

__version__ = "0.1.0"
