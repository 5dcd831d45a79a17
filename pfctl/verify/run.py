"""verify-groupnorm, start to end: load the VAE and a clip, audit, measure every path, judge, report.

1. Audit: hooks on one real one-call forward classify every norm and attention call.
2. Reference: the one-call full-sequence encode in fp32 (posterior mean).
3. Paths: the library's own chunked encode, a sweep of chunk sizes, and pfctl's exact chunked encode,
   each with latent errors, GroupNorm statistics drift, decoded PSNR (same decoder) and flicker.
4. Noise floor F: the one-call path in bf16 against fp32; exact paths in bf16 must stay within 2F.
5. Memory: peak of the one-call and the exact encode (method stated).
6. Verdict against the tolerance table; exit code 0 pass/warn, 1 fail.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

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

DEMO_NOTE = (
    "demonstration of the algebra: this is a tiny random-weight model, so the sizes of the errors say "
    "nothing about a trained VAE; run with --vae FOLDER to measure yours"
)
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


def _encoder_root(vae: Any) -> torch.nn.Module:
    return getattr(vae.module, "encoder", vae.module)


def _chunk_plan(vae: Any, num_frames: int, chunk_frames: int | None) -> list[int]:
    if hasattr(vae, "chunk_plan"):
        return list(vae.chunk_plan(num_frames, chunk_frames))
    tf = int(getattr(vae, "temporal_factor", 8))
    c = chunk_frames or tf
    c = -(-c // tf) * tf
    n, r = max(num_frames // c, 1), num_frames % c
    return [c + r] + [c] * (n - 1) if n > 1 else [num_frames]


def _is_demo(vae: Any, spec: str) -> bool:
    return bool(getattr(vae, "is_demo", spec.endswith("-tiny") or spec == "default"))


# ---------------------------------------------------------------------------------------- judging
def judge(path: PathResult, tol: ToleranceConfig, time_coupled: list[str]) -> None:
    """Set ``path.status`` and ``path.reasons`` from the tolerance table."""
    lat, dec, dr = path.latent or {}, path.decoded or {}, path.drift or {}
    reasons: list[str] = []
    if path.tolerance_class == "exact":
        status = "pass"
        if lat["rel_l2"] > tol.exact_rel_l2 or lat["max_abs"] > tol.exact_max_abs:
            status = "fail"
            reasons.append(
                f"should be exact but relL2 {lat['rel_l2']:.2e} (limit {tol.exact_rel_l2:.0e}), max abs "
                f"{lat['max_abs']:.2e} (limit {tol.exact_max_abs:.0e}): a cache, padding or alignment bug"
            )
        b = path.bf16 or {}
        if b.get("ratio_to_floor") is not None and b["ratio_to_floor"] > tol.bf16_floor_factor:
            status = "fail"
            reasons.append(
                f"bf16 error is {b['ratio_to_floor']:.2f}× the noise floor (limit {tol.bf16_floor_factor})"
            )
        path.status, path.reasons = status, reasons
        return
    levels = []
    rel = lat["rel_l2"]
    levels.append(0 if rel <= tol.approx_rel_l2_pass else 1 if rel <= tol.approx_rel_l2_warn else 2)
    if levels[-1]:
        reasons.append(
            f"latent relL2 {rel:.2e} (pass ≤{tol.approx_rel_l2_pass:.0e}, warn ≤{tol.approx_rel_l2_warn:.0e})"
        )
    p = dec.get("psnr_vs_full")
    if p is not None:
        levels.append(0 if p >= tol.psnr_pass_db else 1 if p >= tol.psnr_warn_db else 2)
        if levels[-1]:
            reasons.append(
                f"decoded PSNR vs full {p:.1f} dB (pass ≥{tol.psnr_pass_db}, warn ≥{tol.psnr_warn_db})"
            )
    d = dec.get("delta_psnr")
    if d is not None:
        levels.append(0 if d <= tol.delta_psnr_pass_db else 1 if d <= tol.delta_psnr_warn_db else 2)
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


# ---------------------------------------------------------------------------------------- main
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


def _contract(vae: Any) -> str:
    if hasattr(vae, "frame_contract"):
        return vae.frame_contract
    return f"1+{getattr(vae, 'temporal_factor', 8)}k"


def _bf16_copy(vae: Any) -> Any:
    clone = copy.deepcopy(vae)
    clone.module.to(torch.bfloat16)
    return clone


def run_verify(config: RecipeConfig) -> GroupNormReport:
    """Run the whole check; returns the report (the CLI renders it and maps ``exit_code``)."""
    from pfctl.runtime.accelerator import resolve_device

    vc = config.verify
    tol = vc.tolerances
    device = resolve_device(vc.device or config.runtime.device)
    notes: list[str] = []
    vae, spec, load_notes = load_any_vae(vc.vae, device=device, seed=vc.seed)
    if vc.exact_offload_above_gib is not None and hasattr(vae, "exact_offload_above"):
        vae.exact_offload_above = int(vc.exact_offload_above_gib * 2**30)
    notes += load_notes
    is_demo = _is_demo(vae, spec)
    if is_demo:
        notes.append(DEMO_NOTE)
    clip = _clip(vc, vae, notes)
    x = clip.video.to(device)
    T = x.shape[2]
    root = _encoder_root(vae)
    eps = group_norm_eps(root)

    # 1. audit (+ the reference statistics of every GroupNorm from the same one-call pass)
    with capture_group_stats(root) as full_stats:
        audit = audit_mod.audit_module(vae.module, lambda: vae.encode(x, chunking="none"))
    flags = audit_mod.check_framewise_flags(vae.module, x)
    tc_names = audit.time_coupled_names()

    # 2. reference
    ref = vae.encode(x, chunking="none").mean.float()
    dec_full = vae.decode(ref) if vc.decode else None
    psnr_full_in = psnr(dec_full.float().cpu(), clip.video) if dec_full is not None else None

    # 3. paths
    exact_class = audit.verdict == audit_mod.EXACT
    specs: list[tuple[str, str, int | None]] = [("library", "framewise", None)]
    specs += [(f"chunk-{c}", "framewise", c) for c in vc.chunk_sizes]
    specs.append(("exact", "exact", vc.exact_chunk_frames))
    paths: list[PathResult] = []
    for name, chunking, c in specs:
        align = vae.chunk_align() if hasattr(vae, "chunk_align") else int(getattr(vae, "temporal_factor", 1))
        c_eff = None if c is None else -(-c // align) * align
        p = PathResult(
            name=name,
            chunking=chunking,
            chunk_frames=c_eff,
            chunk_plan=_chunk_plan(vae, T, c_eff),
            dtype="fp32",
            tolerance_class="exact" if (chunking == "exact" or exact_class) else "approximate",
        )
        try:
            with capture_group_stats(root) as st:
                out = vae.encode(x, chunking=chunking, chunk_frames=c_eff).mean.float()
        except (ConfigError, NotImplementedError, NotBuiltError) as exc:
            p.available, p.error = False, str(getattr(exc, "message", exc)).splitlines()[0]
            paths.append(p)
            continue
        if chunking == "exact":  # the engine normalised with the pooled statistics, not the per-chunk ones
            st = {k: [merge_calls(v)] for k, v in st.items()}
        p.latent = latent_metrics(ref, out)
        layers = layer_drift({k: v for k, v in full_stats.items() if k in st}, st, eps)
        first_over = next(
            (lay.name for lay in layers if max(lay.d_mu_max, lay.d_sigma_max) > tol.drift_warn), None
        )
        p.drift = {
            "threshold": tol.drift_warn,
            "max_d_mu": max((lay.d_mu_max for lay in layers), default=None),
            "max_d_sigma": max((lay.d_sigma_max for lay in layers), default=None),
            "first_over": first_over,
            "layers": [lay.__dict__ for lay in layers],
        }
        if dec_full is not None:
            dec = vae.decode(out)
            in_cpu = clip.video
            p_in = psnr(dec.float().cpu(), in_cpu)
            p.decoded = {
                "psnr_vs_full": psnr(dec.float().cpu(), dec_full.float().cpu()),
                "psnr_full_vs_input": psnr_full_in,
                "psnr_vs_input": p_in,
                "delta_psnr": psnr_full_in - p_in,
                "flicker": flicker_score(dec_full.float().cpu(), dec.float().cpu(), p.chunk_plan),
            }
        paths.append(p)

    # 4. bf16 noise floor and bf16 exact paths
    noise_floor = None
    if "bf16" in vc.dtypes:
        try:
            vae16 = _bf16_copy(vae)
            x16 = x.to(torch.bfloat16)
            full16 = vae16.encode(x16, chunking="none").mean.float()
            floor = latent_metrics(ref, full16)
            noise_floor = {"rel_l2": floor["rel_l2"], "max_abs": floor["max_abs"]}
            for p in paths:
                if not p.available or p.tolerance_class != "exact" or p.name.startswith("chunk-"):
                    continue
                out16 = vae16.encode(x16, chunking=p.chunking, chunk_frames=p.chunk_frames).mean.float()
                rel = latent_metrics(ref, out16)["rel_l2"]
                p.bf16 = {"rel_l2": rel, "ratio_to_floor": rel / max(floor["rel_l2"], 1e-12)}
            del vae16
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            notes.append(f"bf16 noise floor not measured: {type(exc).__name__}: {exc}")

    for p in paths:
        if p.available:
            judge(p, tol, tc_names)

    # 5. memory
    memory = None
    exact = next((p for p in paths if p.name == "exact" and p.available), None)
    if vc.memory and exact is not None:
        mem_frames = vae.valid_num_frames(vc.memory_frames) if vc.memory_frames else T
        xm = x if mem_frames == T else synthetic_clip(mem_frames, x.shape[3], x.shape[4], seed=vc.seed).video
        xm = xm.to(device)
        one_call, method = peak_memory(lambda: vae.encode(xm, chunking="none"), device)
        held: dict[str, int] = {}

        def run_exact() -> None:
            res = _exact_result(vae, xm, exact.chunk_frames)
            held["bytes"] = res

        exact_bytes, _ = peak_memory(run_exact, device)
        memory = {
            "method": method,
            "frames": int(xm.shape[2]),
            "one_call_bytes": one_call,
            "exact_bytes": exact_bytes,
            "ratio": (exact_bytes / one_call) if one_call and exact_bytes is not None else None,
            "exact_held_bytes": held.get("bytes"),
        }

    # 6. verdict
    worst = max((_ORDER[p.status] for p in paths if p.available), default=1)
    status = ["pass", "warn", "fail"][worst]
    if not any(p.available for p in paths):
        notes.append("this VAE offers no chunked encode to check (one-call only)")
    if any(f.severity == "bug" for f in flags):
        notes.append("mis-wired chunking flag found (see audit flags)")
    exit_code = EXIT_CHECK_FAILED if status == "fail" else EXIT_OK
    vae_info = {
        "spec": spec,
        "name": getattr(vae, "name", type(vae.module).__name__),
        "class_name": type(vae.module).__name__,
        "is_demo": is_demo,
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
        exit_code=exit_code,
        vae=vae_info,
        input={
            "source": clip.source,
            "description": clip.description,
            "shape": list(clip.video.shape),
            "fps": clip.fps,
            "events": clip.events,
            "device": str(device),
        },
        audit=audit_dict,
        reference={"path": "one-call", "dtype": "fp32", "psnr_vs_input": psnr_full_in},
        noise_floor=noise_floor,
        paths=paths,
        memory=memory,
        tolerances=tol.model_dump(),
        notes=notes,
    )


def _exact_result(vae: Any, x: torch.Tensor, chunk_frames: int | None) -> int | None:
    """Run the exact encode once (for memory) and return the bytes the engine held at norm boundaries."""
    if getattr(vae, "uses_exact_engine", False):
        from pfctl.models.exact_chunked import exact_chunked_encode

        plan = _chunk_plan(vae, x.shape[2], chunk_frames)
        res = exact_chunked_encode(vae, x, plan, offload_above=getattr(vae, "exact_offload_above", None))
        return res.peak_held_bytes
    vae.encode(x, chunking="exact", chunk_frames=chunk_frames)
    return None


def write_outputs(report: GroupNormReport, json_path: str | None, plot_path: str | None) -> list[str]:
    """Write --json and --plot files (atomically); returns lines to print."""
    from pfctl.utils.io import atomic_write_bytes, atomic_write_json
    from pfctl.verify.report import plot_per_frame_error

    lines = []
    if json_path:
        atomic_write_json(json_path, report.to_dict())
        lines.append(f"report written to {json_path}")
    if plot_path:
        atomic_write_bytes(plot_path, plot_per_frame_error(report))
        lines.append(f"per-latent-frame error plot written to {plot_path}")
    return lines
