"""Run the tests as other x86-64 CPUs run them: the same suite under PyTorch's, MKL's and oneDNN's other kernels.

A CPU without AVX-512 runs other vectorised kernels, and one with more cores splits reductions across more
threads, so its float results differ in the last bits. A tolerance derived from the computation's rounding
holds on all of them; one fitted to this machine's bits does not. Each variant below runs ``pytest`` in a
child process with the variables that make this CPU take another machine's code paths; a line per variant
gives its outcome, and the last line names those that failed.

Usage: python scripts/cpu_variants.py [--variants no-simd,avx2,...] [pytest arguments...]
Exit 0 when every variant passed, 1 when one failed, 2 on a bad variant name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

#: name -> (what it stands for, the environment that makes this CPU run it)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "no-simd": (
        "an x86-64 CPU with no AVX (ATen's scalar kernels, MKL's and oneDNN's SSE4 code)",
        {
            "ATEN_CPU_CAPABILITY": "default",
            "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
            "ONEDNN_MAX_CPU_ISA": "SSE41",
        },
    ),
    "avx2": (
        "a CPU with AVX2 but no AVX-512 (most laptops, older servers)",
        {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    ),
    # a test process runs min(2, cores / pytest-xdist workers) torch threads (tests/conftest.py): one on a small
    # machine, two on a larger one, where every parallel reduction is split in two
    "one-thread": ("a small machine: one torch thread per test process", {"PFCTL_TEST_THREADS": "1"}),
    "two-threads": ("a larger machine: two torch threads per test process", {"PFCTL_TEST_THREADS": "2"}),
}


def run_variant(name: str, pytest_args: list[str]) -> tuple[int, str, float]:
    """``pytest`` under variant ``name``: its exit code, its last line and the seconds it took."""
    env = {**os.environ, **VARIANTS[name][1]}
    tic = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", *pytest_args], env=env, capture_output=True, text=True
    )
    lines = run.stdout.strip().splitlines() or run.stderr.strip().splitlines() or ["no output"]
    return run.returncode, lines[-1], time.perf_counter() - tic


def main(argv: list[str]) -> int:
    names = list(VARIANTS)
    if argv[:1] == ["--variants"]:
        names, argv = (argv[1].split(",") if len(argv) > 1 else []), argv[2:]
        unknown = [n for n in names if n not in VARIANTS] or ([] if names else ["(none given)"])
        if unknown:
            print(
                f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}", file=sys.stderr
            )
            return 2
    failed = []
    for name in names:
        print(f"{name}: {VARIANTS[name][0]} ...", flush=True)
        code, tail, seconds = run_variant(name, argv)
        print(f"{name}: exit {code} in {seconds:.0f} s: {tail}", flush=True)
        if code != 0:
            failed.append(name)
    failures = f"; failed: {', '.join(failed)}" if failed else ""
    print(f"{len(names) - len(failed)} of {len(names)} variants passed{failures}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
