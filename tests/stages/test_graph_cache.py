"""Inductor's FX graph cache serves what the stages made (executor inductor): a recompile of the
same graph in a fresh Dynamo (as in a new process) loads Inductor's code instead of generating it
and gives bitwise the same outputs; the key holds the digest of the k3compile package
(`cache_key_tag`), so code generated for other k3 ops is never reused. AOTAutograd's cache
stays off: its key lacks our options, and a hit would skip every stage."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import k3compile.ops  # noqa: F401
from k3compile.rewrite import trace_cache

# the step is written in k3 ops already: no pattern to trace (CPU Inductor builds are slow enough)
OPTIONS = {"executor": "inductor", "disabled_stages": ("canonicalize", "fuse")}


def step(x, w, u):
    h = torch.ops.k3.rms_norm(x, w, 1e-6)
    return (torch.ops.k3.linear(h, u).sin() * 2, h.cos())


def _compile(args) -> tuple[tuple, dict]:
    torch._dynamo.reset()
    before = {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss")}
    out = torch.compile(step, backend="k3", options=OPTIONS)(*args)
    return out, {k: counters["inductor"][f"fxgraph_cache_{k}"] - v for k, v in before.items()}


def test_a_recompile_loads_inductors_code(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("TORCHINDUCTOR_FX_GRAPH_CACHE", raising=False)
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(3, 1, 32, generator=g), torch.randn(32, generator=g),
            torch.randn(16, 32, generator=g)]
    cold, cold_counts = _compile(args)
    warm, warm_counts = _compile(args)
    assert cold_counts == {"hit": 0, "miss": 1}
    assert warm_counts == {"hit": 1, "miss": 0}
    assert all(torch.equal(a, b) for a, b in zip(cold, warm, strict=True))
    want = step(*args)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(cold, want))


@pytest.mark.slow
def test_an_edited_package_misses(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("TORCHINDUCTOR_FX_GRAPH_CACHE", raising=False)
    args = [torch.randn(3, 1, 32), torch.randn(32), torch.randn(16, 32)]
    assert _compile(args)[1] == {"hit": 0, "miss": 1}
    monkeypatch.setattr(trace_cache, "package_digest", lambda: "an edited k3compile")
    assert _compile(args)[1] == {"hit": 0, "miss": 1}


def test_aotautograd_cache_stays_off(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(2, 1, 32, generator=g), torch.randn(32, generator=g),
            torch.randn(8, 32, generator=g)]
    before = {k: v for k, v in counters["aot_autograd"].items() if "autograd_cache" in k}
    _compile(args)
    _compile(args)
    after = {k: v for k, v in counters["aot_autograd"].items() if "autograd_cache" in k}
    assert after.get("autograd_cache_hit", 0) == before.get("autograd_cache_hit", 0)


def test_generated_code_checks_no_input_again(tmp_path, monkeypatch):
    """Inductor's per-input size/stride asserts stay out of the code it generates for us
    (`inductor.INPUT_ASSERTS_OFF`): Dynamo's guards check every input's sizes and strides
    already, and torch generates them in O(inputs^2), which a model with one input per expert
    weight pays at every compile. What the code computes is unchanged."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(2)
    args = [torch.randn(2, 1, 32, generator=g), torch.randn(32, generator=g),
            torch.randn(8, 32, generator=g)]
    out, codes = run_and_get_code(torch.compile(step, backend="k3", options=OPTIONS), *args)
    assert codes and "def call(" in codes[0]
    assert not any("assert_size_stride(" in code for code in codes)
    want = step(*args)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(out, want))


_lib = torch.library.Library("k3_test_fallbacks", "FRAGMENT")  # an op no lowering has seen yet
_lib.define("double(Tensor x) -> Tensor")
_lib.impl("double", lambda x: x * 2, "CompositeExplicitAutograd")
_lib.impl("double", lambda x: torch.empty_like(x), "Meta")


def test_custom_ops_get_their_fallback_before_lowering(caplog):
    """torch 2.11 formats Inductor's "Creating implicit fallback" line (every argument as IR)
    even with INFO off: ~55 s of the first bucket on the H200. `register_fallbacks` registers the
    same fallback first, so Inductor never takes that branch; the compiled values stay eager's."""
    from torch._inductor.lowering import lowerings
    from torch.fx.experimental.proxy_tensor import make_fx

    from k3compile.rewrite import inductor

    op = torch.ops.k3_test_fallbacks.double.default
    x = torch.randn(4, 8)
    gm = make_fx(lambda x: (op(x.sin()).cos(),))(x)
    assert op not in lowerings
    inductor.register_fallbacks(gm)
    assert op in lowerings
    with caplog.at_level("INFO", logger="torch._inductor.graph"):
        compiled = inductor.compile_fx_static(gm, [x])
    assert "implicit fallback" not in caplog.text
    torch.testing.assert_close(compiled(x)[0], (x.sin() * 2).cos())
