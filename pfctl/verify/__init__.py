"""verify-groupnorm: is chunked ("framewise") VAE encoding equal to a one-call encode?

- :mod:`pfctl.verify.audit` — hooks on a real forward classify norms (time-coupled / per-frame /
  channel-only) and attention, and test chunking flags;
- the exact chunked encode it measures lives in :mod:`pfctl.models.exact_chunked` (encode-latents
  uses it too);
- :mod:`pfctl.verify.measure` — statistics drift, latent/decoded errors, flicker, peak memory;
- :mod:`pfctl.verify.report` — the JSON schema, rich tables, PNG plot;
- :mod:`pfctl.verify.run` — the command from config to report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pfctl.config.schema import RecipeConfig
    from pfctl.verify.report import GroupNormReport
    from pfctl.verify.run import Progress


def verify_groupnorm(config: RecipeConfig, progress: Progress | None = None) -> GroupNormReport:
    """Run the check described by ``config.verify``; write --json/--plot outputs; return the report.

    ``progress(step, done, total)`` hears when each step starts (see :data:`pfctl.verify.run.Progress`).
    """
    from pfctl.verify.run import run_verify, write_outputs

    report = run_verify(config, progress)
    write_outputs(report, config.verify.json_path, config.verify.plot_path)
    return report
