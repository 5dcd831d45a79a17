"""Property-based fuzzing of annotation and recipe parsing (hypothesis).

The property: any input either parses or raises the documented error type
(:class:`~pfctl.errors.InputError` for annotations, :class:`~pfctl.errors.ConfigError` for
recipes and ``--set``) — never another exception, which the CLI would report as an internal error.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pfctl.config.load import load_config
from pfctl.data.annotations import load_annotations
from pfctl.errors import ConfigError, InputError

KEYS = ["id", "video", "image", "text", "frames", "fps", "extra"]
SECTIONS = ["runtime", "model", "encode", "train", "generate", "verify", "description", "bogus"]
FIELDS = ["device", "seed", "max_steps", "lr", "batch_size", "buckets", "fps", "num_frames", "dtype",
          "sample_ratios", "nan_policy", "resume", "collective_timeout_s", "dit_preset", "typo"]  # fmt: skip

json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip
media = st.sampled_from(["a.mp4", "x/../b.mov", "~nouser/c.mp4", "", "  ", "\x00.mp4", "é ü.mkv", "/abs.png"])
rows = st.dictionaries(
    st.sampled_from(KEYS), st.one_of(json_values, media), min_size=0, max_size=len(KEYS)
) | st.fixed_dictionaries(  # mostly valid rows, so the accepting path is exercised too
    {"video": media, "text": st.text(max_size=20)},
    optional={"id": st.text(max_size=8) | st.integers(), "fps": json_scalars, "frames": json_values},
)


class Counter:
    def __init__(self) -> None:
        self.ok = self.rejected = 0
        self.bugs: list[str] = []

    def record(self, fn) -> None:
        try:
            fn()
            self.ok += 1
        except (InputError, ConfigError):
            self.rejected += 1
        except Exception as exc:  # the property is violated
            self.bugs.append(f"{type(exc).__name__}: {exc}")
            raise


def _settings(n: int):
    return settings(
        max_examples=n, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )  # fmt: skip


def fuzz_annotations(n: int = 100) -> Counter:
    counter = Counter()
    folder = Path(tempfile.mkdtemp(prefix="pfctl-fuzz-ann-"))

    @_settings(n)
    @given(st.lists(rows, max_size=4), st.sampled_from([".jsonl", ".csv"]), st.booleans())
    def check(table: list[dict], suffix: str, raw: bool) -> None:
        path = folder / f"ann{suffix}"
        if suffix == ".jsonl":
            text = "".join(json.dumps(r) + "\n" for r in table)
        else:
            columns = sorted({k for r in table for k in r}) or ["video", "text"]
            lines = [",".join(columns)] + [",".join(str(r.get(c, "")) for c in columns) for r in table]
            text = "\n".join(lines) + "\n"
        path.write_text(text if not raw else text[: len(text) // 2], encoding="utf-8", errors="surrogatepass")
        counter.record(lambda: load_annotations(path))

    @_settings(n)
    @given(st.binary(max_size=200) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")))
    def check_raw(blob: bytes) -> None:
        for suffix in (".jsonl", ".csv"):
            path = folder / f"raw{suffix}"
            path.write_bytes(blob)
            counter.record(lambda path=path: load_annotations(path))

    check()
    check_raw()
    return counter


recipe_values = st.recursive(
    json_scalars | st.sampled_from(["cpu", "cuda", "auto", "bf16", "1e-4", "nan", "inf", "stop", "latest"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(FIELDS), inner, max_size=3),
    max_leaves=8,
)
recipes = st.dictionaries(st.sampled_from(SECTIONS), recipe_values, max_size=4)
overrides = st.lists(
    st.builds(
        lambda s, f, v: f"{s}.{f}={v}",
        st.sampled_from(SECTIONS),
        st.sampled_from(FIELDS),
        st.text(max_size=10)
        | st.sampled_from(["[1, 2]", "{a: 1}", "!!python/name:os.system", "null", "[", "1e-4"]),
    )
    | st.text(max_size=20),
    max_size=3,
)


def fuzz_recipes(n: int = 100) -> Counter:
    counter = Counter()
    folder = Path(tempfile.mkdtemp(prefix="pfctl-fuzz-recipe-"))

    @_settings(n)
    @given(recipes, overrides)
    def check(recipe: dict, sets: list[str]) -> None:
        path = folder / "r.yaml"
        path.write_text(yaml.safe_dump(recipe, allow_unicode=True), encoding="utf-8")
        counter.record(lambda: load_config(str(path), sets))

    @_settings(n)
    @given(st.text(max_size=200))
    def check_text(text: str) -> None:
        path = folder / "t.yaml"
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
        counter.record(lambda: load_config(str(path)))

    check()
    check_text()
    return counter
