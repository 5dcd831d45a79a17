"""The verify-groupnorm report: a stable JSON schema, a rich rendering, an optional PNG plot.

JSON conventions: every number is a plain float/int; a PSNR of identical videos (infinite) is ``null``;
``schema_version`` changes whenever a key is renamed or removed (adding keys keeps the version).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1

TOP_KEYS = frozenset(
    {
        "schema_version",
        "tool",
        "status",
        "exit_code",
        "vae",
        "input",
        "audit",
        "reference",
        "noise_floor",
        "paths",
        "memory",
        "tolerances",
        "notes",
    }
)
PATH_KEYS = frozenset(
    {
        "name",
        "chunking",
        "chunk_frames",
        "chunk_plan",
        "dtype",
        "tolerance_class",
        "requested_chunk_frames",
        "available",
        "error",
        "latent",
        "decoded",
        "drift",
        "bf16",
        "status",
        "reasons",
    }
)
AUDIT_KEYS = frozenset(
    {"verdict", "coupled_by", "counts", "first_offending", "norms", "attention", "flags", "frame_contract"}
)


@dataclass
class PathResult:
    name: str
    chunking: str
    chunk_frames: int | None
    chunk_plan: list[int]
    dtype: str
    tolerance_class: str  # "exact" or "approximate"
    requested_chunk_frames: list[int] | None = None
    """Chunk sizes asked for that this path runs (rounded up to what the VAE allows); None: not asked."""
    available: bool = True
    error: str | None = None
    latent: dict[str, Any] | None = None
    decoded: dict[str, Any] | None = None
    drift: dict[str, Any] | None = None
    bf16: dict[str, Any] | None = None
    status: str = "n/a"
    reasons: list[str] = field(default_factory=list)


@dataclass
class GroupNormReport:
    status: str
    exit_code: int
    vae: dict[str, Any]
    input: dict[str, Any]
    audit: dict[str, Any]
    reference: dict[str, Any]
    noise_floor: dict[str, Any] | None
    paths: list[PathResult]
    memory: dict[str, Any] | None
    tolerances: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    schema_version: int = SCHEMA_VERSION
    tool: str = "pfctl verify-groupnorm"

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(asdict(self))

    def path(self, name: str) -> PathResult:
        return next(p for p in self.paths if p.name == name)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------- rendering
def _fmt(v: Any, spec: str = ".2e") -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if math.isinf(v):
            return "∞"
        return format(v, spec)
    return str(v)


_STYLE = {"pass": "green", "warn": "yellow", "fail": "red", "n/a": "dim"}
_WEIGHTS = {
    "random": " [yellow](tiny random-weight model: a demonstration of the algebra, not of a trained VAE)[/]",
    "trained-embedded": " [yellow](pfctl's embedded VAE: trained, but small and on synthetic shapes only)[/]",
}


def path_label(p: PathResult) -> str:
    """The row name, with the chunk sizes asked for when the VAE made the path run another size."""
    asked = [c for c in p.requested_chunk_frames or [] if c != p.chunk_frames]
    return f"{p.name} (asked {','.join(map(str, asked))})" if asked else p.name


def render(report: GroupNormReport, console: Any = None) -> None:
    """Print the report as rich tables (plain text when not on a terminal)."""
    if console is None:
        from rich.console import Console

        from pfctl.runtime.logging import use_rich

        rich_on = use_rich()
        console = Console(
            highlight=False, force_terminal=None if rich_on else False, width=None if rich_on else 160
        )
    _render_header(report, console)
    console.print(_paths_table(report))
    _render_drift(report, console)
    _render_footer(report, console)


def _render_header(report: GroupNormReport, console: Any) -> None:
    """VAE, input, audit verdict with counts, flags, noise floor."""
    vae, audit = report.vae, report.audit
    console.print(f"[bold]VAE[/] {vae['name']} ({vae['spec']}){_WEIGHTS.get(vae.get('weights'), '')}")
    console.print(f"[bold]input[/] {report.input['description']}  shape {report.input['shape']}")
    counts = audit["counts"]
    console.print(
        f"[bold]audit[/] verdict [bold]{audit['verdict']}[/]: {counts['time_coupled']} time-coupled, "
        f"{counts['per_frame']} per-frame, {counts['channel_only']} channel-only norms; "
        f"{counts['attention_cross_frame']} cross-frame / {counts['attention_per_frame']} per-frame attention; "
        f"frame contract {audit['frame_contract']['rule']}"
    )
    if audit["first_offending"]:
        console.print("  first offending: " + ", ".join(audit["first_offending"]))
    for f in audit["flags"]:
        colour = {"bug": "red", "warning": "yellow"}.get(f["severity"], "dim")
        console.print(f"  [{colour}]{f['severity']}[/]: {f['message']}")
    if report.noise_floor:
        console.print(
            f"[bold]bf16 noise floor F[/] (one-call bf16 vs fp32): relL2 {_fmt(report.noise_floor['rel_l2'])}"
        )


def _paths_table(report: GroupNormReport) -> Any:
    """One row per path: chunks, latent and decoded errors, drift, bf16 ratio, status."""
    from rich.table import Table

    table = Table(title="chunked vs one-call encode (posterior mean, fp32)", show_lines=False)
    for col in (
        "path",
        "chunks",
        "relL2",
        "max abs",
        "worst frame",
        "PSNR vs full",
        "ΔPSNR",
        "flicker",
        "max d_μ",
        "max d_σ",
        "bf16/F",
        "status",
    ):
        table.add_column(col, justify="right" if col not in ("path", "chunks") else "left")
    for p in report.paths:
        if not p.available:
            table.add_row(path_label(p), "—", *["—"] * 9, f"[dim]n/a[/] {p.error or ''}")
            continue
        lat, dec, dr = p.latent or {}, p.decoded or {}, p.drift or {}
        plan = p.chunk_plan
        plan_s = ",".join(map(str, plan)) if len(plan) <= 6 else f"{plan[0]},{plan[1]}…×{len(plan)}"
        per_frame = lat.get("per_frame_rel_l2") or []
        table.add_row(
            path_label(p),
            plan_s,
            _fmt(lat.get("rel_l2")),
            _fmt(lat.get("max_abs")),
            _fmt(max(per_frame) if per_frame else None),
            _fmt(dec.get("psnr_vs_full"), ".1f"),
            _fmt(dec.get("delta_psnr"), ".3f"),
            _fmt(dec.get("flicker"), ".1f"),
            _fmt(dr.get("max_d_mu"), ".3f"),
            _fmt(dr.get("max_d_sigma"), ".3f"),
            _fmt((p.bf16 or {}).get("ratio_to_floor"), ".2f"),
            f"[{_STYLE[p.status]}]{p.status}[/]",
        )
    return table


def _render_drift(report: GroupNormReport, console: Any) -> None:
    """GroupNorm statistics drift of the library path, first layers."""
    from rich.table import Table

    lib = next((p for p in report.paths if p.name == "library" and p.drift and p.drift.get("layers")), None)
    if lib is not None:
        dt = Table(title=f"GroupNorm statistics drift, library path ({lib.drift['threshold']} = warn)")
        for col in ("layer", "chunks", "d_μ max", "d_μ p95", "d_σ max", "d_σ p95"):
            dt.add_column(col, justify="left" if col == "layer" else "right")
        for layer in lib.drift["layers"][:12]:
            dt.add_row(
                layer["name"],
                str(layer["chunks"]),
                _fmt(layer["d_mu_max"], ".3f"),
                _fmt(layer["d_mu_p95"], ".3f"),
                _fmt(layer["d_sigma_max"], ".3f"),
                _fmt(layer["d_sigma_p95"], ".3f"),
            )
        console.print(dt)
        if lib.drift.get("first_over"):
            console.print(f"  first layer over {lib.drift['threshold']}: {lib.drift['first_over']}")


def _render_footer(report: GroupNormReport, console: Any) -> None:
    """Memory, reasons of every non-passing path, notes, the result."""
    if report.memory:
        m = report.memory
        ratio = _fmt(m.get("ratio"), ".2f")
        console.print(
            f"[bold]peak memory[/] ({m['method']}; {m['frames']} frames): one-call "
            f"{_mib(m.get('one_call_bytes'))}, exact {_mib(m.get('exact_bytes'))} (ratio {ratio}); "
            f"activations the exact schedule kept across chunks (parked norm inputs or checkpoint): "
            f"{_mib(m.get('exact_held_bytes'))}"
        )
    for p in report.paths:
        for r in p.reasons:
            console.print(f"  [{_STYLE[p.status]}]{p.name}[/]: {r}")
    for n in report.notes:
        console.print(f"[dim]note:[/] {n}")
    colour = _STYLE.get(report.status, "white")
    console.print(f"[bold {colour}]{report.status.upper()}[/] (exit code {report.exit_code})")


def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:.1f} MiB"
