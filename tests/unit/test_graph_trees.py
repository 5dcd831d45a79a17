"""The indexed questions of Inductor's CUDA-graph trees give the trees' own answers (CPU: fake paths)."""

from __future__ import annotations

import random

import pytest
from torch import nn

from pfctl.models.fast import graph_trees


class _Ref:
    """A storage weak reference as the trees hold it: its pointer, and the storage while it lives."""

    def __init__(self, ptr: int, live: bool) -> None:
        self.ptr, self.live = ptr, live

    def __call__(self) -> object | None:
        return object() if self.live else None

    def data_ptr(self) -> int:
        return self.ptr


class _Storage:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _Tensor:
    def __init__(self, ptr: int) -> None:
        self.storage = _Storage(ptr)

    def untyped_storage(self) -> _Storage:
        return self.storage


class _Node:
    """What the alias question reads of a node: its path's weak references."""

    def __init__(self, path_weakrefs: list) -> None:
        self.path_weakrefs = path_weakrefs


def _random_path(rng: random.Random) -> list:
    """Levels of outputs on a few storages (so several refs share one), some dead, some None."""
    return [
        [
            None if rng.random() < 0.1 else _Ref(rng.randrange(12) * 512, rng.random() < 0.6)
            for _ in range(rng.randrange(9))
        ]
        for _ in range(rng.randrange(30))
    ]


@pytest.fixture(scope="module")
def trees():
    from torch._inductor import cudagraph_trees

    if not graph_trees.index_recorded_outputs():
        pytest.skip("this PyTorch's CUDA-graph trees lack what the index relies on")
    return cudagraph_trees


@pytest.mark.parametrize("name", ["_is_alias_of_live_recorded_tensor", "_is_cuda_graph_recorded_tensor"])
def test_the_index_answers_as_the_trees_scan(trees, name: str) -> None:
    question = getattr(trees.CUDAGraphNode, name)
    rng = random.Random(0)
    answers = set()
    for _ in range(300):
        node = _Node(_random_path(rng))
        for ptr in (rng.randrange(14) * 512 for _ in range(6)):
            scanned = question(node, _Tensor(ptr))  # no index: the trees' own scan
            node.__dict__[graph_trees._INDEX] = None  # as inside a wrapped method
            indexed = question(node, _Tensor(ptr))
            del node.__dict__[graph_trees._INDEX]
            assert indexed == scanned
            answers.add(scanned in (None, False))
    assert answers == {True, False}  # both kinds of answer were compared


def test_the_index_lives_for_one_call_and_nests(trees) -> None:
    seen = []

    def method(node, inner: bool) -> None:
        seen.append(node.__dict__[graph_trees._INDEX])
        assert not trees.CUDAGraphNode._is_cuda_graph_recorded_tensor(node, _Tensor(512))
        if inner:
            wrapped(node, False)  # a fresh index inside, which sees what the inner call added
            assert trees.CUDAGraphNode._is_cuda_graph_recorded_tensor(node, _Tensor(512))  # rebuilt after
        else:
            node.path_weakrefs[-1].append(_Ref(512, True))  # as recording adds the node's first outputs

    wrapped = graph_trees._indexed_while(method)
    node = _Node([[_Ref(0, True)], []])
    wrapped(node, True)
    assert seen == [None, None]
    assert graph_trees._INDEX not in node.__dict__


def test_compiled_blocks_with_graphs_index_the_trees(trees) -> None:
    """Compiled blocks with graphs index the trees, and silence PyTorch's warning about recording many sizes (one
    per graph past 8 token counts): the trainer's log lists the counts a rank records."""
    import torch._inductor.config as inductor_config

    from pfctl.models.fast.compile import compile_blocks

    with inductor_config.patch({"triton.cudagraph_dynamic_shape_warn_limit": 8}):
        compile_blocks([nn.Linear(2, 2)], "eager", cuda_graphs=True)
        assert inductor_config.triton.cudagraph_dynamic_shape_warn_limit is None
    assert trees.CUDAGraphNode._pfctl_indexed
    assert graph_trees.index_recorded_outputs()  # once per process: a second call changes nothing


def test_compiled_blocks_say_when_the_trees_cannot_be_indexed(monkeypatch, capsys) -> None:
    from pfctl.models.fast.compile import compile_blocks

    monkeypatch.setattr(graph_trees, "index_recorded_outputs", lambda: False)  # a PyTorch whose trees differ
    compile_blocks([nn.Linear(2, 2)], "eager", cuda_graphs=True)
    assert "their own alias scan" in capsys.readouterr().out
    compile_blocks([nn.Linear(2, 2)], "eager", cuda_graphs=False)  # no graphs: nothing to say
    assert "alias scan" not in capsys.readouterr().out


def test_recordings_begun_reads_the_trees_count(monkeypatch) -> None:
    """0 before the device's trees exist (here: no CUDA), the manager's count once they do, None where the
    trees keep none."""
    from types import SimpleNamespace

    from torch._inductor import cudagraph_trees as trees

    assert graph_trees.recordings_begun(0) == 0
    monkeypatch.setattr(trees, "get_manager", lambda index, create_if_none_exists: SimpleNamespace(debug_fail_counter=3))
    assert graph_trees.recordings_begun(0) == 3
    monkeypatch.setattr(trees, "get_manager", lambda index, create_if_none_exists: SimpleNamespace())
    assert graph_trees.recordings_begun(0) is None
