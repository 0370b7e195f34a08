"""The pipeline as data: `stages(options)` is the one place that decides which stages run, in
order; the `check` stage runs the engine's invariants and the side-stream hazard checker."""

from __future__ import annotations

import pytest
import torch

import k3compile.ops  # noqa: F401
from k3compile import pipeline
from k3compile.rewrite import inductor
from k3compile.settings import Options
from k3compile.stages import Context
from k3compile.stages.check import InvariantError, check

ALL = [name for name, _ in pipeline.STAGES]


def _names(**options):
    return [name for name, _ in pipeline.stages(Options.make(options))]


def test_default_stage_list(monkeypatch):
    for var in ("K3_VERIFY", "K3_SIDE_STREAMS", "K3_PACK_WEIGHTS", "K3_STACK_INPUTS"):
        monkeypatch.delenv(var, raising=False)
    assert ALL == ["normalize", "canonicalize", "fuse", "verify", "writeback", "shard", "streams",
                   "prefetch", "check", "ranks", "contract", "conv_layout", "pack",
                   "stack_inputs"]
    assert _names() == [n for n in ALL if n != "verify"]  # verify is off by default


@pytest.mark.parametrize("option,stage", [("verify", "verify"), ("side_streams", "streams"),
                                          ("check_ranks", "ranks"), ("pack_weights", "pack"),
                                          ("pack_weights", "conv_layout"),
                                          ("stack_inputs", "stack_inputs")])
def test_an_option_switches_its_stage(monkeypatch, option, stage):
    for var in ("K3_VERIFY", "K3_SIDE_STREAMS", "K3_PACK_WEIGHTS", "K3_STACK_INPUTS"):
        monkeypatch.delenv(var, raising=False)
    assert stage in _names(**{option: True})
    off = _names(**{option: False})
    assert stage not in off and off == [n for n in ALL if n in off]  # order kept


def test_environment_switches_reach_the_list(monkeypatch):
    monkeypatch.setenv("K3_VERIFY", "1")
    monkeypatch.setenv("K3_SIDE_STREAMS", "0")
    names = _names()
    assert "verify" in names and "streams" not in names
    assert "verify" not in _names(verify=False)  # an explicit option wins over the environment


def test_disabled_stages(monkeypatch):
    monkeypatch.delenv("K3_VERIFY", raising=False)
    names = _names(disabled_stages={"shard", "contract"}, verify=True)
    assert "shard" not in names and "contract" not in names and "verify" in names
    with pytest.raises(ValueError, match="unknown stages"):
        _names(disabled_stages={"fusee"})


def test_pipeline_runs_its_list(monkeypatch):
    from k3compile.observe import Observer

    monkeypatch.delenv("K3_VERIFY", raising=False)
    p = pipeline.Pipeline(Options.make({"disabled_stages": {"pack", "ranks"}}), Observer())
    gm = inductor.fwd_only_fake(lambda x: torch.relu(x) + 1.0, [torch.randn(2, 4)])
    p.run(gm, Context(p.options, None))
    assert [r.name for r in p.observer.records[None]] == [n for n, _ in p.stages]
    assert "contract" in p.observer.notes[None]


@pytest.mark.parametrize("keep", [None, True])
def test_graph_text_is_kept_only_where_asked(monkeypatch, keep):
    """A printed graph is O(nodes) per stage: the records hold one only where the options ask
    (`keep_graphs`, as the diff tool does), never by default."""
    from k3compile.observe import Observer

    monkeypatch.delenv("K3_VERIFY", raising=False)
    options = Options.make({"disabled_stages": {"pack", "ranks"},
                            **({} if keep is None else {"keep_graphs": keep})})
    p = pipeline.Pipeline(options, Observer(options.keep_graphs))
    gm = inductor.fwd_only_fake(lambda x: torch.relu(x) + 1.0, [torch.randn(2, 4)])
    p.run(gm, Context(p.options, None))
    texts = [r.graph_after for r in p.observer.records[None]]
    assert all("relu" in t for t in texts) if keep else not any(texts)


def test_no_tensor_leaves_the_stages_in_the_graph_modules_meta(monkeypatch):
    """Inductor's FX graph cache pickles the GraphModule, meta included, hashing each tensor
    there by value: the real inputs the stages read (every weight) must not reach it."""
    from torch._inductor.codecache import FxGraphCachePickler

    from k3compile.observe import Observer

    monkeypatch.delenv("K3_VERIFY", raising=False)
    p = pipeline.Pipeline(Options.make({"disabled_stages": {"pack", "ranks"}}), Observer())
    weight = torch.randn(256, 1024)
    gm = inductor.fwd_only_fake(lambda x, w: x @ w.t(), [torch.randn(2, 1024), weight])
    gm = p.run(gm, Context(p.options, None, inputs=[torch.randn(2, 1024), weight]))
    leaves = torch.utils._pytree.tree_leaves(dict(gm.meta))
    assert not any(isinstance(x, torch.Tensor) for x in leaves), gm.meta.keys()
    assert len(FxGraphCachePickler(gm).dumps(gm)) < weight.numel()  # no weight's values in it


# ---- check: invariants and hazards ----------------------------------------------------------------

def _ctx():
    return Context(Options(), None)


def test_check_passes_a_plain_graph():
    gm = inductor.fwd_only_fake(lambda x: torch.relu(x) + 1.0, [torch.randn(2, 4)])
    check(gm, _ctx())


def test_check_refuses_a_node_without_meta():
    gm = inductor.fwd_only_fake(lambda x: torch.relu(x) + 1.0, [torch.randn(2, 4)])
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    del relu.meta["val"]
    with pytest.raises(InvariantError, match="no meta"):
        check(gm, _ctx())


def test_check_runs_the_stream_hazard_checker():
    """A compute op marked for the side stream with no fork/join: `hazards` names it."""
    gm = inductor.fwd_only_fake(lambda x: torch.relu(x) + 1.0, [torch.randn(2, 4)])
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.meta["k3_stream"] = 1
    with pytest.raises(InvariantError, match="stream"):
        check(gm, _ctx())
