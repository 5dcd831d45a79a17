"""verify-groupnorm, start to end: load the VAE and a clip, audit, measure every path, judge, report.

1. Audit: hooks on one real one-call forward classify every norm and attention call.
2. Reference: the one-call full-sequence encode in fp32 (posterior mean).
3. Paths: the library's own chunked encode, a sweep of chunk sizes, and the exact chunked encode,
   each with latent errors, GroupNorm statistics drift, decoded PSNR (same decoder) and flicker.
4. Noise floor F: the one-call path in bf16 against fp32; exact paths in bf16 must stay within 2F.
5. Memory: peak of the one-call and the exact encode (method stated).
6. Verdict against the tolerance table; exit code 0 pass/warn, 1 fail.

Each step is one function of a :class:`_Run` (what the steps share); ``progress`` hears of every step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pfctl.errors import EXIT_CHECK_FAILED, EXIT_OK, ConfigError, InputError, ModelLoadError, NotBuiltError
from pfctl.verify import audit as audit_mod
from pfctl.verify.measure import (
    capture_group_stats,
    flicker_score,
    group_norm_eps,
    latent_metrics,
    layer_drift,
    merge_calls,
    peak_memory,
    psnr,
)
from pfctl.verify.report import GroupNormReport, PathResult
from pfctl.verify.synthetic import Clip, load_clip, synthetic_clip

if TYPE_CHECKING:
    from pfctl.config.schema import RecipeConfig
    from pfctl.config.verify import ToleranceConfig, VerifyConfig

Progress = Callable[[str, int, int | None], None]
"""``progress(step, done, total)``: a step starts; ``done`` steps are finished (``total``: None until known)."""

RANDOM_NOTE = (
    "demonstration of the algebra: this is a tiny random-weight model, so the sizes of the errors say "
    "nothing about a trained VAE; run with --vae FOLDER to measure yours"
)
EMBEDDED_NOTE = (
    "the embedded VAE is trained, but small and on synthetic shapes only: its errors show how this "
    "architecture chunks, not the sizes a production VAE gives; run with --vae FOLDER to measure yours"
)
_UNCACHED_FRAMEWISE = {
    "ltx": "LTX-Video's chunked encode runs overlapping temporal tiles blended at the joins, without a "
    "causal-conv cache",
    "hunyuan": "HunyuanVideo's chunked encode runs overlapping temporal tiles blended at the joins, without "
    "a causal-conv cache",
}
"""Libraries whose chunked encode is approximate by construction, whatever their norms."""
_ORDER = {"pass": 0, "n/a": 0, "warn": 1, "fail": 2}


# ---------------------------------------------------------------------------------------- loading
def load_any_vae(spec: str | None, *, device: str, seed: int = 0) -> tuple[Any, str, list[str]]:
    """(adapter, spec used, notes). Diffusers classes load here; pfctl's causal VAE via pfctl.models.vae."""
    from pfctl.models.diffusers_vae import is_diffusers_spec, load_diffusers_vae

    notes: list[str] = []
    if spec is None:
        try:
            from pfctl.models.vae import load_vae

            return load_vae("default", device=device), "default", notes
        except Exception:
            spec = "causal-vae-tiny"
            notes.append("no embedded demo VAE in this build: using causal-vae-tiny")
    if is_diffusers_spec(spec):
        return load_diffusers_vae(spec, device=device, seed=seed), spec, notes
    try:
        from pfctl.models.vae import load_vae
    except ImportError:
        raise ModelLoadError(
            f"cannot load VAE '{spec}': pfctl's causal VAE adapter (pfctl.models.vae) is not in this build",
            hint="use a diffusers VAE: cogvideox-tiny, wan-tiny, ltx-tiny, hunyuan-tiny, mochi-tiny or a folder",
        ) from None
    return load_vae(spec, device=device), spec, notes


def weights_kind(spec: str) -> str:
    """ "trained-embedded" (pfctl's embedded demo VAE), "random" (built-in ``*-tiny``) or "user" (a folder)."""
    if spec == "default":
        return "trained-embedded"
    return "random" if spec.endswith("-tiny") else "user"


def _encoder_root(vae: Any) -> nn.Module:
    return getattr(vae.module, "encoder", vae.module)


def _align(vae: Any) -> int:
    return int(vae.chunk_align()) if hasattr(vae, "chunk_align") else int(getattr(vae, "temporal_factor", 1))


def _contract(vae: Any) -> str:
    if hasattr(vae, "frame_contract"):
        return vae.frame_contract
    return f"1+{getattr(vae, 'temporal_factor', 8)}k"


@dataclass
class _Run:
    """What the steps share: settings, the VAE, the clip, and the reference once computed."""

    vc: VerifyConfig
    device: torch.device | str
    vae: Any
    spec: str
    clip: Clip
    x: torch.Tensor
    notes: list[str]
    progress: Progress
    done: int = 0
    total: int | None = None
    full_stats: dict[str, Any] = field(default_factory=dict)
    ref: torch.Tensor | None = None
    dec_full: torch.Tensor | None = None
    psnr_full_in: float | None = None

    @property
    def tol(self) -> ToleranceConfig:
        return self.vc.tolerances

    @property
    def root(self) -> nn.Module:
        return _encoder_root(self.vae)

    def step(self, description: str) -> None:
        """Report that a step starts (the previous one, if any, is finished)."""
        self.progress(description, self.done, self.total)
        self.done += 1


@dataclass
class _PathSpec:
    name: str
    chunking: str
    chunk_frames: int | None
    requested: list[int] = field(default_factory=list)


def _clip(vc: VerifyConfig, vae: Any, notes: list[str]) -> Clip:
    n = vae.valid_num_frames(vc.num_frames)
    if n == 0:
        raise InputError(f"verify.num_frames={vc.num_frames} is below the VAE's smallest clip")
    if n != vc.num_frames:
        notes.append(f"{vc.num_frames} frames break the VAE's frame contract ({_contract(vae)}): using {n}")
    sf = int(getattr(vae, "spatial_factor", 8))
    h, w = max(sf, vc.height // sf * sf), max(sf, vc.width // sf * sf)
    if (h, w) != (vc.height, vc.width):
        notes.append(f"size {vc.width}x{vc.height} rounded to {w}x{h} (multiples of {sf})")
    if vc.video:
        return load_clip(vc.video, n, h, w, fps=vc.fps)
    return synthetic_clip(n, h, w, fps=vc.fps or 8.0, seed=vc.seed)


def _prepare(config: RecipeConfig, progress: Progress) -> _Run:
    from pfctl.runtime.accelerator import resolve_device

    vc = config.verify
    device = resolve_device(vc.device or config.runtime.device)
    progress(f"loading VAE {vc.vae or 'default'}", 0, None)
    vae, spec, notes = load_any_vae(vc.vae, device=device, seed=vc.seed)
    if hasattr(vae, "exact_schedule"):
        vae.exact_schedule = vc.exact_schedule
        vae.exact_checkpoint_bytes = _gib_bytes(vc.exact_checkpoint_gib)
        vae.exact_offload_above = _gib_bytes(vc.exact_offload_above_gib)
    kind = weights_kind(spec)
    if kind != "user":
        notes.append(EMBEDDED_NOTE if kind == "trained-embedded" else RANDOM_NOTE)
    clip = _clip(vc, vae, notes)
    return _Run(vc, device, vae, spec, clip, clip.video.to(device), notes, progress, done=1)


# ---------------------------------------------------------------------------------------- steps
def _audit(run: _Run) -> tuple[audit_mod.AuditResult, list[audit_mod.FlagFinding]]:
    """Classify norms and attention from one one-call forward (and keep its GroupNorm statistics)."""
    run.step("audit: one one-call forward with hooks")
    vae, x = run.vae, run.x
    with capture_group_stats(run.root) as full_stats:
        audit = audit_mod.audit_module(vae.module, lambda: vae.encode(x, chunking="none"))
    run.full_stats = full_stats
    return audit, audit_mod.check_framewise_flags(vae.module, x)


def _reference(run: _Run) -> None:
    run.step("reference: one-call encode in fp32" + (" and its decode" if run.vc.decode else ""))
    run.ref = run.vae.encode(run.x, chunking="none").mean.float()
    if run.vc.decode:
        run.dec_full = run.vae.decode(run.ref).float().cpu()
        run.psnr_full_in = psnr(run.dec_full, run.clip.video)


def _path_specs(run: _Run) -> list[_PathSpec]:
    """The library's chunked path, one path per distinct chunk size (rounded up to what the VAE allows,
    with a note when that changes a requested size), and the exact path."""
    align = _align(run.vae)

    def effective(c: int) -> int:
        return -(-c // align) * align

    sizes: dict[int, list[int]] = {}
    for c in run.vc.chunk_sizes:
        sizes.setdefault(effective(c), []).append(c)
    specs = [_PathSpec("library", "framewise", None)]
    for eff, asked in sizes.items():
        specs.append(_PathSpec(f"chunk-{eff}", "framewise", eff, asked))
        moved = [c for c in asked if c != eff]
        if moved:
            run.notes.append(
                f"chunk size {', '.join(map(str, moved))} ran as {eff} frames (row chunk-{eff}): this VAE's "
                f"chunks must be multiples of {align} frames"
            )
    c = run.vc.exact_chunk_frames
    specs.append(_PathSpec("exact", "exact", None if c is None else effective(c), [] if c is None else [c]))
    return specs


def tolerance_class(chunking: str, verdict: str, vae: Any) -> tuple[str, str | None]:
    """("exact" | "approximate", why a path of a model that could be chunked exactly is not).

    The exact path must be exact. The library's and the swept paths must be exact when the audit finds
    nothing that couples frames *and* the library carries causal context between chunks; libraries that
    blend overlapping tiles instead are approximate by construction, whatever the norms.
    """
    if chunking == "exact":
        return "exact", None
    if verdict != audit_mod.EXACT:
        return "approximate", None
    why = _UNCACHED_FRAMEWISE.get(getattr(vae, "family", ""))
    return ("approximate", why) if why else ("exact", None)


def _observed_plan(run: _Run, spec: _PathSpec, calls: list[int]) -> list[int]:
    """Frames per encoder call of this path: the adapter's own plan when it has one (tiles overlap, so
    calls do not add up), else what the encoder was seen to receive."""
    T = run.x.shape[2]
    if spec.chunking == "exact" and hasattr(run.vae, "exact_plan"):
        return list(run.vae.exact_plan(T, spec.chunk_frames))
    if hasattr(run.vae, "chunk_plan"):
        return list(run.vae.chunk_plan(T, spec.chunk_frames))
    return calls if sum(calls) == T else [T]


def _measure_path(run: _Run, spec: _PathSpec, verdict: str, tc_names: list[str]) -> PathResult:
    """Encode with one chunking; latent errors, statistics drift, decoded PSNR and flicker."""
    size = "library default" if spec.chunk_frames is None else f"{spec.chunk_frames}-frame"
    run.step(f"path {spec.name}: {spec.chunking} encode, {size} chunks")
    cls, _ = tolerance_class(spec.chunking, verdict, run.vae)
    p = PathResult(
        name=spec.name,
        chunking=spec.chunking,
        chunk_frames=spec.chunk_frames,
        chunk_plan=[],
        dtype="fp32",
        tolerance_class=cls,
        requested_chunk_frames=spec.requested or None,
    )
    calls: list[int] = []
    hook = run.root.register_forward_pre_hook(
        lambda _m, args: calls.append(int(args[0].shape[2])) if args else None
    )
    try:
        with capture_group_stats(run.root) as st:
            out = run.vae.encode(run.x, chunking=spec.chunking, chunk_frames=spec.chunk_frames).mean.float()
    except (ConfigError, NotImplementedError, NotBuiltError) as exc:
        p.available, p.error = False, str(getattr(exc, "message", exc)).splitlines()[0]
        return p
    finally:
        hook.remove()
    p.chunk_plan = _observed_plan(run, spec, calls)
    if spec.chunking == "exact":  # the engine normalised with the pooled statistics, not per-chunk ones
        st = {k: [merge_calls(v)] for k, v in st.items()}
    p.latent = latent_metrics(run.ref, out)
    p.drift = _drift(run, st)
    if run.dec_full is not None:
        dec = run.vae.decode(out).float().cpu()
        p_in = psnr(dec, run.clip.video)
        p.decoded = {
            "psnr_vs_full": psnr(dec, run.dec_full),
            "psnr_full_vs_input": run.psnr_full_in,
            "psnr_vs_input": p_in,
            "delta_psnr": run.psnr_full_in - p_in,
            "flicker": flicker_score(run.dec_full, dec, p.chunk_plan),
        }
    judge(p, run.tol, tc_names)
    return p


def _drift(run: _Run, chunked: dict[str, Any]) -> dict[str, Any]:
    full = {k: v for k, v in run.full_stats.items() if k in chunked}
    layers = layer_drift(full, chunked, group_norm_eps(run.root))
    limit = run.tol.drift_warn
    first_over = next((lay.name for lay in layers if max(lay.d_mu_max, lay.d_sigma_max) > limit), None)
    return {
        "threshold": limit,
        "max_d_mu": max((lay.d_mu_max for lay in layers), default=None),
        "max_d_sigma": max((lay.d_sigma_max for lay in layers), default=None),
        "first_over": first_over,
        "layers": [lay.__dict__ for lay in layers],
    }


def bf16_copy(vae: Any) -> Any:
    """A deep copy of the adapter with its module in bf16.

    ``nn.Module.to`` itself, not diffusers' ``ModelMixin.to``: that one warns about "modules that should
    be kept in float32" on every dtype cast, even when the list is empty (no module here needs fp32).
    """
    clone = copy.deepcopy(vae)
    nn.Module.to(clone.module, torch.bfloat16)
    return clone


def _bf16(run: _Run, paths: list[PathResult], tc_names: list[str]) -> dict[str, float] | None:
    """Noise floor F (one-call bf16 vs fp32) and the bf16 error of every exact path, judged again."""
    if "bf16" not in run.vc.dtypes:
        return None
    run.step("bf16: noise floor and exact paths in bf16")
    try:
        vae16 = bf16_copy(run.vae)
        x16 = run.x.to(torch.bfloat16)
        floor = latent_metrics(run.ref, vae16.encode(x16, chunking="none").mean.float())
        for p in paths:
            if not p.available or p.tolerance_class != "exact" or p.name.startswith("chunk-"):
                continue
            out16 = vae16.encode(x16, chunking=p.chunking, chunk_frames=p.chunk_frames).mean.float()
            rel = latent_metrics(run.ref, out16)["rel_l2"]
            p.bf16 = {"rel_l2": rel, "ratio_to_floor": rel / max(floor["rel_l2"], 1e-12)}
            judge(p, run.tol, tc_names)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        run.notes.append(f"bf16 noise floor not measured: {type(exc).__name__}: {exc}")
        return None
    return {"rel_l2": floor["rel_l2"], "max_abs": floor["max_abs"]}


def _memory(run: _Run, paths: list[PathResult]) -> dict[str, Any] | None:
    """Peak memory of the one-call encode and of the exact encode (same clip, same counting)."""
    exact = next((p for p in paths if p.name == "exact" and p.available), None)
    if not run.vc.memory or exact is None:
        return None
    run.step("memory: peak of the one-call and the exact encode")
    vae, T = run.vae, run.x.shape[2]
    frames = vae.valid_num_frames(run.vc.memory_frames) if run.vc.memory_frames else T
    xm = run.x
    if frames != T:
        xm = synthetic_clip(frames, xm.shape[3], xm.shape[4], seed=run.vc.seed).video.to(run.device)
    one_call, method = peak_memory(lambda: vae.encode(xm, chunking="none"), run.device, vae.module)
    held: dict[str, int | None] = {}

    def run_exact() -> None:
        held["bytes"] = _exact_result(vae, xm, exact.chunk_frames)

    exact_bytes, _ = peak_memory(run_exact, run.device, vae.module)
    return {
        "method": method,
        "frames": int(xm.shape[2]),
        "one_call_bytes": one_call,
        "exact_bytes": exact_bytes,
        "ratio": (exact_bytes / one_call) if one_call and exact_bytes is not None else None,
        "exact_held_bytes": held.get("bytes"),
    }


def _gib_bytes(gib: float | None) -> int | None:
    return None if gib is None else int(gib * 2**30)


def _exact_result(vae: Any, x: torch.Tensor, chunk_frames: int | None) -> int | None:
    """Run the exact encode once (for memory) and return the bytes its schedule kept across chunks:
    norm inputs held at norm boundaries (``parked``) or the checkpoint between passes (``recompute``)."""
    if getattr(vae, "uses_exact_engine", False):
        plan = list(vae.exact_plan(x.shape[2], chunk_frames))
        if vae.exact_schedule == "recompute":
            from pfctl.models.exact_recompute import exact_recompute_encode

            return exact_recompute_encode(
                vae, x, plan, checkpoint_bytes=vae.exact_checkpoint_bytes
            ).peak_checkpoint_bytes
        from pfctl.models.exact_chunked import exact_chunked_encode

        return exact_chunked_encode(vae, x, plan, offload_above=vae.exact_offload_above).peak_held_bytes
    vae.encode(x, chunking="exact", chunk_frames=chunk_frames)
    return None


# ---------------------------------------------------------------------------------------- judging
def judge(path: PathResult, tol: ToleranceConfig, time_coupled: list[str]) -> None:
    """Set ``path.status`` and ``path.reasons`` from the tolerance table."""
    if path.tolerance_class == "exact":
        _judge_exact(path, tol)
        return
    lat, dec, dr = path.latent or {}, path.decoded or {}, path.drift or {}
    reasons: list[str] = []

    def level(value: float, pass_at: float, warn_at: float, higher_is_better: bool = False) -> int:
        if higher_is_better:
            return 0 if value >= pass_at else 1 if value >= warn_at else 2
        return 0 if value <= pass_at else 1 if value <= warn_at else 2

    rel = lat["rel_l2"]
    levels = [level(rel, tol.approx_rel_l2_pass, tol.approx_rel_l2_warn)]
    if levels[-1]:
        reasons.append(
            f"latent relL2 {rel:.2e} (pass ≤{tol.approx_rel_l2_pass:.0e}, warn ≤{tol.approx_rel_l2_warn:.0e})"
        )
    p = dec.get("psnr_vs_full")
    if p is not None:
        levels.append(level(p, tol.psnr_pass_db, tol.psnr_warn_db, higher_is_better=True))
        if levels[-1]:
            reasons.append(
                f"decoded PSNR vs full {p:.1f} dB (pass ≥{tol.psnr_pass_db}, warn ≥{tol.psnr_warn_db})"
            )
    d = dec.get("delta_psnr")
    if d is not None:
        levels.append(level(d, tol.delta_psnr_pass_db, tol.delta_psnr_warn_db))
        if levels[-1]:
            reasons.append(
                f"ΔPSNR against the input {d:.3f} dB (pass ≤{tol.delta_psnr_pass_db}, warn ≤{tol.delta_psnr_warn_db})"
            )
    early = set(time_coupled[: tol.early_layers])
    over = [
        layer["name"]
        for layer in dr.get("layers", [])
        if layer["name"] in early and max(layer["d_mu_max"], layer["d_sigma_max"]) > tol.drift_warn
    ]
    if over:
        levels.append(1)
        reasons.append(f"statistics drift > {tol.drift_warn} in early GroupNorm(s): {', '.join(over)}")
    path.status = ["pass", "warn", "fail"][max(levels)]
    path.reasons = reasons


def _judge_exact(path: PathResult, tol: ToleranceConfig) -> None:
    lat, b = path.latent or {}, path.bf16 or {}
    status, reasons = "pass", []
    if lat["rel_l2"] > tol.exact_rel_l2 or lat["max_abs"] > tol.exact_max_abs:
        status = "fail"
        reasons.append(
            f"should be exact but relL2 {lat['rel_l2']:.2e} (limit {tol.exact_rel_l2:.0e}), max abs "
            f"{lat['max_abs']:.2e} (limit {tol.exact_max_abs:.0e}): a cache, padding or alignment bug"
        )
    if b.get("ratio_to_floor") is not None and b["ratio_to_floor"] > tol.bf16_floor_factor:
        status = "fail"
        reasons.append(
            f"bf16 error is {b['ratio_to_floor']:.2f}× the noise floor (limit {tol.bf16_floor_factor})"
        )
    path.status, path.reasons = status, reasons


# ---------------------------------------------------------------------------------------- main
def run_verify(config: RecipeConfig, progress: Progress | None = None) -> GroupNormReport:
    """Run the whole check; returns the report (the CLI renders it and maps ``exit_code``)."""
    run = _prepare(config, progress or (lambda _step, _done, _total: None))
    specs = _path_specs(run)
    run.total = run.done + 2 + len(specs) + ("bf16" in run.vc.dtypes) + bool(run.vc.memory)
    audit, flags = _audit(run)
    tc_names = audit.time_coupled_names()
    _, why = tolerance_class("framewise", audit.verdict, run.vae)
    if why:
        run.notes.append(
            f"verdict {audit.verdict} describes the model (no norm or attention couples frames), but the "
            f"chunked rows are judged as approximate: {why}; exact chunking would need that cache"
        )
    _reference(run)
    paths = [_measure_path(run, spec, audit.verdict, tc_names) for spec in specs]
    noise_floor = _bf16(run, paths, tc_names)
    memory = _memory(run, paths)
    run.progress("done", run.total, run.total)
    return _report(run, audit, flags, paths, noise_floor, memory)


def _report(
    run: _Run,
    audit: audit_mod.AuditResult,
    flags: list[audit_mod.FlagFinding],
    paths: list[PathResult],
    noise_floor: dict[str, float] | None,
    memory: dict[str, Any] | None,
) -> GroupNormReport:
    vae, vc, clip, T = run.vae, run.vc, run.clip, run.x.shape[2]
    worst = max((_ORDER[p.status] for p in paths if p.available), default=1)
    status = ["pass", "warn", "fail"][worst]
    notes = run.notes
    if not any(p.available for p in paths):
        notes.append("this VAE offers no chunked encode to check (one-call only)")
    if any(f.severity == "bug" for f in flags):
        notes.append("mis-wired chunking flag found (see audit flags)")
    vae_info = {
        "spec": run.spec,
        "name": getattr(vae, "name", type(vae.module).__name__),
        "class_name": type(vae.module).__name__,
        "weights": weights_kind(run.spec),
        "is_demo": weights_kind(run.spec) != "user",
        "fingerprint": vae.fingerprint(),
        "latent_channels": int(vae.latent_channels),
        "temporal_factor": int(getattr(vae, "temporal_factor", 0)),
        "spatial_factor": int(getattr(vae, "spatial_factor", 0)),
        "library_chunking": vae.chunking_note() if hasattr(vae, "chunking_note") else None,
    }
    audit_dict = {
        "verdict": audit.verdict,
        "coupled_by": audit.coupled_by,
        "counts": audit.counts(),
        "first_offending": audit.first_offending,
        "norms": [n.__dict__ for n in audit.norms],
        "attention": [a.__dict__ for a in audit.attention],
        "flags": [f.__dict__ for f in flags],
        "frame_contract": {
            "rule": _contract(vae),
            "requested": vc.num_frames,
            "used": T,
            "valid": vae.valid_num_frames(vc.num_frames) == vc.num_frames,
        },
    }
    return GroupNormReport(
        status=status,
        exit_code=EXIT_CHECK_FAILED if status == "fail" else EXIT_OK,
        vae=vae_info,
        input={
            "source": clip.source,
            "description": clip.description,
            "shape": list(clip.video.shape),
            "fps": clip.fps,
            "events": clip.events,
            "device": str(run.device),
        },
        audit=audit_dict,
        reference={"path": "one-call", "dtype": "fp32", "psnr_vs_input": run.psnr_full_in},
        noise_floor=noise_floor,
        paths=paths,
        memory=memory,
        tolerances=run.tol.model_dump(),
        notes=notes,
    )


def write_outputs(report: GroupNormReport, json_path: str | None, plot_path: str | None) -> list[str]:
    """Write --json and --plot files (atomically); returns lines to print."""
    from pfctl.utils.io import atomic_write_bytes, atomic_write_json
    from pfctl.verify.plot import plot_per_frame_error

    lines = []
    if json_path:
        atomic_write_json(json_path, report.to_dict())
        lines.append(f"report written to {json_path}")
    if plot_path:
        atomic_write_bytes(plot_path, plot_per_frame_error(report))
        lines.append(f"per-latent-frame error plot written to {plot_path}")
    return lines
