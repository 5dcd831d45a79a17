"""Regenerate completions/pfctl.{bash,zsh,fish} from the Typer app.

Usage: python scripts/gen_completions.py [--check]
With --check, exit 1 if a committed file differs from what the app generates now.
"""

from __future__ import annotations

import sys
from pathlib import Path

from typer.testing import CliRunner

from pfctl.cli.app import app

SHELLS = {"bash": "source_bash", "zsh": "source_zsh", "fish": "source_fish"}
OUT = Path(__file__).resolve().parents[1] / "completions"


def render(shell: str) -> str:
    result = CliRunner().invoke(app, [], env={"_PFCTL_COMPLETE": SHELLS[shell]}, prog_name="pfctl")
    if result.exit_code != 0 or not result.output.strip():
        raise SystemExit(f"could not render {shell} completion: {result.output}")
    return result.output


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for shell in SHELLS:
        path = OUT / f"pfctl.{shell}"
        text = render(shell)
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.name)
        else:
            OUT.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale completions: {', '.join(stale)}; run python scripts/gen_completions.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
