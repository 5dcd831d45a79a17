"""The verify-groupnorm report: a stable JSON schema, a rich rendering, an optional PNG plot.

JSON conventions: every number is a plain float/int; a PSNR of identical videos (infinite) is ``null``;
``schema_version`` changes whenever a key is renamed or removed (adding keys keeps the version).
"""

from __future__ import annotations

import math
import struct
import zlib
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


def render(report: GroupNormReport, console: Any = None) -> None:
    """Print the report as rich tables (plain text when not on a terminal)."""
    from rich.table import Table

    if console is None:
        from rich.console import Console

        from pfctl.runtime.logging import use_rich

        rich_on = use_rich()
        console = Console(
            highlight=False, force_terminal=None if rich_on else False, width=None if rich_on else 160
        )
    vae, audit = report.vae, report.audit
    demo = " [yellow](tiny random-weight model: a demonstration of the algebra, not of a trained VAE)[/]"
    console.print(f"[bold]VAE[/] {vae['name']} ({vae['spec']}){demo if vae['is_demo'] else ''}")
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
            table.add_row(p.name, "—", *["—"] * 9, f"[dim]n/a[/] {p.error or ''}")
            continue
        lat, dec, dr = p.latent or {}, p.decoded or {}, p.drift or {}
        plan = p.chunk_plan
        plan_s = ",".join(map(str, plan)) if len(plan) <= 6 else f"{plan[0]},{plan[1]}…×{len(plan)}"
        per_frame = lat.get("per_frame_rel_l2") or []
        table.add_row(
            p.name,
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
    console.print(table)
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
    if report.memory:
        m = report.memory
        ratio = _fmt(m.get("ratio"), ".2f")
        console.print(
            f"[bold]peak memory[/] ({m['method']}; {m['frames']} frames): one-call "
            f"{_mib(m.get('one_call_bytes'))}, exact {_mib(m.get('exact_bytes'))} (ratio {ratio}); "
            f"activations held at norm boundaries by the exact engine: {_mib(m.get('exact_held_bytes'))}"
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


# ---------------------------------------------------------------------------------------- PNG plot
_COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def png_bytes(pixels: list[bytearray], width: int, height: int) -> bytes:
    """Encode RGB rows (each ``3*width`` bytes) as a PNG (zlib, filter 0) — no imaging library needed."""
    raw = b"".join(b"\x00" + bytes(row) for row in pixels)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def plot_per_frame_error(report: GroupNormReport, width: int = 640, height: int = 320) -> bytes:
    """Per-latent-frame relL2 of each available path, log10 y axis from 1e-8 to 1, one colour per path
    (in the order of the report's table); dotted grid lines at each decade. Returns PNG bytes."""
    pix = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]
    margin = 20
    lo, hi = -8.0, 0.0

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            pix[y][3 * x : 3 * x + 3] = bytes(rgb)

    def ypos(v: float) -> int:
        lv = min(hi, max(lo, math.log10(max(v, 1e-12))))
        return round(height - margin - (lv - lo) / (hi - lo) * (height - 2 * margin))

    for d in range(int(lo), int(hi) + 1):
        y = ypos(10.0**d)
        for x in range(margin, width - margin, 4):
            put(x, y, (200, 200, 200))
    for y in range(margin, height - margin + 1):
        put(margin, y, (0, 0, 0))
    for x in range(margin, width - margin):
        put(x, height - margin, (0, 0, 0))
    series = [p for p in report.paths if p.available and p.latent]
    for i, p in enumerate(series):
        vals = p.latent["per_frame_rel_l2"]
        rgb = _COLOURS[i % len(_COLOURS)]
        n = len(vals)
        xs = [margin + round(j * (width - 2 * margin - 1) / max(n - 1, 1)) for j in range(n)]
        ys = [ypos(v) for v in vals]
        for j in range(n - 1):
            steps = max(abs(xs[j + 1] - xs[j]), abs(ys[j + 1] - ys[j]), 1)
            for s in range(steps + 1):
                x = xs[j] + (xs[j + 1] - xs[j]) * s // steps
                y = ys[j] + (ys[j + 1] - ys[j]) * s // steps
                put(x, y, rgb)
                put(x, y + 1, rgb)
        for x, y in zip(xs, ys, strict=True):
            for dx in (-2, -1, 0, 1, 2):
                for dy in (-2, -1, 0, 1, 2):
                    put(x + dx, y + dy, rgb)
        for dx in range(10):  # legend swatch, top left, one row per path
            for dy in range(6):
                put(margin + 6 + dx, 4 + i * 8 + dy, rgb)
    return png_bytes(pix, width, height)
