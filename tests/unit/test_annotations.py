"""Annotation inputs: JSONL, CSV, folders; validation messages name the file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pfctl.data.annotations import load_annotations
from pfctl.errors import InputError


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_rows_resolve_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    ann = _jsonl(
        tmp_path / "sub" / "train.jsonl",
        [
            {"video": "clips/a.mp4", "text": "a red circle"},
            {"video": "/abs/b.mp4", "text": "b", "id": "bee", "fps": 30, "frames": [0, 2, 4]},
            {"image": "img.png", "text": "an image"},
            {"video": "c.mp4", "text": "", "latent": "ignored.pt"},  # reference fields are ignored
        ],
    )
    items = load_annotations(ann)
    assert [i.id for i in items] == ["clips/a", "bee", "img", "c"]
    assert items[0].path == tmp_path / "sub" / "clips" / "a.mp4"
    assert items[0].kind == "video" and items[0].frames is None and items[0].fps is None
    assert items[1].path == Path("/abs/b.mp4") and items[1].fps == 30.0 and items[1].frames == (0, 2, 4)
    assert items[2].kind == "image" and items[2].path == tmp_path / "sub" / "img.png"
    assert [i.line for i in items] == [1, 2, 3, 4]


def test_jsonl_errors_name_the_line(tmp_path: Path) -> None:
    ann = tmp_path / "a.jsonl"
    ann.write_text('{"video": "a.mp4", "text": "x"}\n\n{not json}\n')
    with pytest.raises(InputError, match=r"a\.jsonl:3: not valid JSON"):
        load_annotations(ann)
    _jsonl(ann, [{"video": "a.mp4", "text": "x"}, {"video": "b.mp4"}])
    with pytest.raises(InputError, match=r"a\.jsonl:2: missing 'text'"):
        load_annotations(ann)
    _jsonl(ann, [{"text": "x"}])
    with pytest.raises(InputError, match=r"missing 'video'"):
        load_annotations(ann)
    _jsonl(ann, [{"video": "a.mp4", "text": "x", "frames": [3, -1]}])
    with pytest.raises(InputError, match="frames"):
        load_annotations(ann)
    _jsonl(ann, [{"video": "a.mp4", "text": "x", "fps": "fast"}])
    with pytest.raises(InputError, match="fps"):
        load_annotations(ann)


def test_duplicated_ids_name_both_lines(tmp_path: Path) -> None:
    ann = _jsonl(
        tmp_path / "a.jsonl",
        [{"video": "x.mp4", "text": "1"}, {"video": "y.mp4", "text": "2"}, {"video": "x.mp4", "text": "3"}],
    )
    with pytest.raises(InputError) as info:
        load_annotations(ann)
    assert "duplicated id 'x'" in info.value.message
    assert "line 1" in info.value.message and "line 3" in info.value.message
    _jsonl(ann, [{"video": "x.mp4", "text": "1", "id": "k"}, {"video": "y.mp4", "text": "2", "id": "k"}])
    with pytest.raises(InputError, match=r"line 1.*line 2"):
        load_annotations(ann)


def test_csv_rows_and_bad_columns(tmp_path: Path) -> None:
    ann = tmp_path / "a.csv"
    ann.write_text('video,text,frames,fps,id\nv/a.mp4,"hello, world","0 2 4",25,\nb.mp4,plain,,,bee\n')
    items = load_annotations(ann)
    assert [i.id for i in items] == ["v/a", "bee"]
    assert items[0].text == "hello, world" and items[0].frames == (0, 2, 4) and items[0].fps == 25.0
    assert items[0].line == 2 and items[0].path == tmp_path / "v" / "a.mp4"
    ann.write_text("path,caption\na.mp4,x\n")
    with pytest.raises(InputError) as info:
        load_annotations(ann)
    assert (
        "'video'" in info.value.message and "'text'" in info.value.message and "'path'" in info.value.message
    )
    ann.write_text("video,caption\na.mp4,x\n")
    with pytest.raises(InputError, match="'text'"):
        load_annotations(ann)


def test_folder_with_captions(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("a.mp4", "sub/b.mov", "c.png"):
        (tmp_path / name).write_bytes(b"")
        (tmp_path / name).with_suffix(".txt").write_text(f"caption of {name}\n")
    (tmp_path / "notes.md").write_text("ignored")
    items = load_annotations(tmp_path)
    assert [(i.id, i.kind) for i in items] == [("a", "video"), ("c", "image"), ("sub/b", "video")]
    assert items[0].text == "caption of a.mp4"
    (tmp_path / "d.mp4").write_bytes(b"")
    with pytest.raises(InputError, match=r"no caption: d\.mp4"):
        load_annotations(tmp_path)


def test_missing_and_unknown_annotation_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist") as info:
        load_annotations(tmp_path / "nope.jsonl")
    assert info.value.exit_code == 2
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(InputError, match="unknown type"):
        load_annotations(tmp_path / "a.txt")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match="no rows"):
        load_annotations(tmp_path / "empty.jsonl")


@pytest.mark.parametrize(
    ("name", "head"),
    [
        ("a.jsonl", b'{"video": "a.mp4", "text": "ok"}\n{"video": "b.mp4", "text": "fine"}\n'),
        ("a.csv", b'video,text\na.mp4,ok\nb.mp4,"fine"\n'),
    ],
)
def test_raw_non_utf8_bytes_name_the_line(tmp_path: Path, name: str, head: bytes) -> None:
    """A Latin-1 caption (0xe9 = 'é') on the last line: the error names the line and column, not only an offset."""
    ann = tmp_path / name
    bad = b'{"video": "c.mp4", "text": "caf\xe9"}\n' if name.endswith(".jsonl") else b"c.mp4,caf\xe9\n"
    ann.write_bytes(head + bad)
    with pytest.raises(InputError) as info:
        load_annotations(ann)
    line, column = head.count(b"\n") + 1, bad.index(b"\xe9") + 1
    assert f"{ann}:{line}: not valid UTF-8 (byte 0xe9 at column {column}" in info.value.message
    assert "UTF-8" in (info.value.hint or "")


def test_non_utf8_caption_file_names_the_line(tmp_path: Path) -> None:
    (tmp_path / "a.mp4").write_bytes(b"")
    (tmp_path / "a.txt").write_bytes(b"first line\n\xff\n")
    with pytest.raises(InputError, match=r"a\.txt:2: not valid UTF-8 \(byte 0xff at column 1"):
        load_annotations(tmp_path)
