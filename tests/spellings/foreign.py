"""What the tests of a foreign K3 spelling loaded from the built-in model's state dict share
(tests/e2e/test_redteam_spelling.py, tests/e2e/test_spell5..10_spelling.py): the 4-layer tiny
built-in model, the decode loop that compares a step against its eager twin, the eager check
against the built-in, the compile, the contract's fused ops per layer, the ops a spelling's plan
lacks, the layers where a pattern's near misses name a node, and `define_common_tests`, which
writes the tests built from these into a spelling's test module."""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import pytest
import torch

import k3compile.backend as k3be
from k3compile.models import build_model, get_config
from tests.conftest import TOL, rel_err
from tests.diffsuite.spellings import condition_for_bf16

# Every template (dense, kda_moe, mla_moe, last) in 4 layers, as in test_spellings
CFG = dataclasses.replace(get_config("tiny"), num_hidden_layers=4, full_attn_layers=(2, 3))
STEPS = 3
_LAYER = re.compile(r"(?:layers|blocks)\.(\d+)\.")  # spell6 names its layers `blocks`


def builtin(dtype, seed=0, cfg=CFG):
    model = build_model(cfg, dtype=dtype, max_batch=4, max_seq_len=64, seed=seed)
    return condition_for_bf16(model, seed) if dtype == torch.bfloat16 else model


def builtin_states(model):
    return {n: b for n, b in model.named_buffers() if b.dim() >= 3 and b.dtype != torch.uint8}


def steps(step, eager, n=STEPS, rows=0):
    """Worst logits error of `step` against `eager` over n decode steps of batch 2 (slots 2, 0);
    `rows` > 0: that many verify rows per request."""
    gen = torch.Generator().manual_seed(0)
    pos, slots, err = torch.tensor([0, 5]), torch.tensor([2, 0]), 0.0
    with torch.no_grad():
        for _ in range(n):
            ids = torch.randint(0, CFG.vocab_size, (2, rows) if rows else (2,), generator=gen)
            got, want = step(ids, pos, slots), eager(ids, pos, slots)
            assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
            err = max(err, rel_err(got, want))
            pos = pos + max(rows, 1)
    return err


def last_compiled():
    return k3be.last_compiled()


def compile_k3(model, **options):
    torch._dynamo.reset()
    return torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "keep_graphs": False, **options})


def per_layer(compiled):
    (report,) = compiled.contracts.values()
    return {lr.layer: lr.actual for lr in report.layers}


def run(dtype, from_builtin, state_of):
    """(worst logits error, each state's error, the compiled backend) of the spelling compiled
    against its eager twin, both loaded from the built-in model."""
    model, eager = from_builtin(builtin(dtype)), from_builtin(builtin(dtype))
    err = steps(compile_k3(model), eager)
    want, got = state_of(eager), state_of(model)
    return err, {n: rel_err(got[n], want[n]) for n in want}, k3be.last_compiled()


def run_on_cuda(dtype, from_builtin, cfg=CFG):
    """(worst logits error, the compiled backend) of the spelling compiled on CUDA against its
    eager twin there, both loaded from the built-in model of `cfg` (the step's inputs moved to
    CUDA)."""
    model = from_builtin(builtin(dtype, cfg=cfg)).cuda()
    eager = from_builtin(builtin(dtype, cfg=cfg)).cuda()

    def on_cuda(fn):
        return lambda *args: fn(*(a.cuda() for a in args))

    err = steps(on_cuda(compile_k3(model)), on_cuda(eager))
    return err, k3be.last_compiled()


def assert_cuda_plans_as_the_cpu_one(from_builtin, lost_fp32: dict, reference) -> None:
    """On CUDA, fp32: the spelling's plan loses what the CPU's loses (`lost_fp32`, its test's
    LOST) and, beyond it, only ops that GPU graphs defer for want of a CUDA kernel
    (`report.deferred`); the step equals its eager twin (spell6's test, session 26, shared)."""
    err, compiled = run_on_cuda(torch.float32, from_builtin)
    assert err <= TOL["aten_cpu"], err
    got = lost(reference, per_layer(compiled))
    (report,) = compiled.observer.reports.values()
    for layer, ops in lost_fp32.items():  # what the CPU loses is lost here too
        assert got.get(layer, {}).items() >= ops.items(), (layer, got)
    more = {op for layer, ops in got.items() for op in ops if op not in lost_fp32.get(layer, {})}
    assert more <= set(report.deferred), (more, report.deferred)


def reference_plan():
    """The built-in model's fused ops per layer (fp32)."""
    steps(compile_k3(builtin(torch.float32)), builtin(torch.float32), n=1)
    return per_layer(k3be.last_compiled())


def lost(reference, got):
    """layer -> the reference plan's ops `got` lacks (layers with none left out)."""
    assert set(got) == set(reference)
    missing = {layer: dict(reference[layer] - got[layer]) for layer in reference}
    return {k: v for k, v in missing.items() if v}


def layer_of(module: str) -> int | None:
    m = _LAYER.search(module + ".")
    if m:
        return int(m.group(1))
    return -1 if module.startswith("final_") else None


def near_misses_naming_a_node(compiled, pattern):
    """layer -> `pattern`'s near misses whose reason names a node."""
    (report,) = compiled.observer.reports.values()
    named = collections.defaultdict(list)
    for nm in report.near_misses:
        if nm.pattern.split("[")[0] == pattern and re.search(r"node=|\(\S+ \w+\[", nm.reason):
            named[layer_of(nm.module)].append(nm)
    return named


def assert_eager_equals_builtin(from_builtin, state_of, tol: float, rows: int = 0):
    """The spelling loaded from the fp32 built-in model's state dict steps as it does: logits
    over 4 steps and the six states after them, each within `tol`."""
    ref = builtin(torch.float32)
    spelled = from_builtin(ref)
    err = steps(spelled, ref, n=4, rows=rows)
    assert err <= tol, err
    want, got = builtin_states(ref), state_of(spelled)
    assert set(got) == set(want) and len(want) == 6
    for name, t in want.items():
        assert rel_err(got[name], t) <= tol, name


def assert_compiled_equals_eager(result, tol: float, states: int = 6):
    """`run`'s result: the compiled step's output and each of its `states` states within `tol`
    of the spelling's own eager step."""
    err, state_err, _ = result
    assert err <= tol, err
    assert len(state_err) == states
    for name, e in state_err.items():
        assert e <= tol, (name, e)


def assert_lost_where_near_missed(result, pattern: str, lost: dict):
    """Every layer of `lost` (layer -> lost ops) that lost `pattern` (or its `fb_` form) has a
    near miss of it naming a node; at least one layer lost it."""
    named = near_misses_naming_a_node(result[2], pattern)
    lost_at = [layer for layer, ops in lost.items() if pattern in ops or f"fb_{pattern}" in ops]
    assert lost_at
    for layer in lost_at:
        assert named.get(layer), (pattern, layer)


def assert_probes_restore(from_builtin, probes: tuple, restored: dict, eager_tol: float) -> None:
    """With `probes` on (`set_probe`: the named idioms switched to another spelling of the same
    math) the spelling still steps as the built-in model (fp32, within `eager_tol`), and compiled
    it has each op of `restored` (layer -> ops) once in that layer: the probes name a gap's
    cause."""
    ref = builtin(torch.float32)
    model = from_builtin(ref).set_probe(*probes)
    err = steps(model, ref, n=2)
    assert err <= eager_tol, (probes, err)  # a probe keeps the math
    steps(compile_k3(from_builtin(ref).set_probe(*probes)), model, n=1)
    got = per_layer(last_compiled())
    for layer, ops in restored.items():
        for op in ops:
            assert got[layer][op] == 1, (probes, layer, op, dict(got[layer]))


def define_common_tests(namespace: dict, name: str, from_builtin, state_of, *,
                        lost_by_dtype: dict, eager_tol: float, rows: tuple | None = (0, 3),
                        diagnosed: tuple | None = None,
                        near_miss_test: str = "test_lost_fusions_have_a_near_miss_naming_a_node"
                        ) -> None:
    """Defines in `namespace` (a spelling test module's `globals()`) the fixtures and tests every
    foreign spelling has, under the names pytest collects them by:

    * fixtures `reference_plan` (the built-in model's plan) and `{name}_fp32` / `{name}_bf16`
      (`run`'s result in that dtype), module-scoped;
    * `test_loads_the_builtin_state_dict_and_equals_it_eagerly`: within `eager_tol`, per verify
      `rows` (not parametrized where `rows` is None: one token);
    * slow, per dtype: `test_compiled_equals_its_eager` (fp32 within TOL["aten_cpu"], bf16
      within TOL["diffsuite_bf16"]) and `test_lost_fusions_are_exactly_the_known_gaps`
      (`lost_by_dtype`, the module's LOST: dtype -> layer -> the reference plan's ops the
      spelling lacks, exactly);
    * slow, where `diagnosed` (pairs (pattern, dtype), the module's DIAGNOSED) is given, even
      empty: `near_miss_test`, every layer that loses the pattern has a near miss of it naming
      a node.

    LOST and DIAGNOSED stay data in the calling module, where gap-closing changes edit them."""
    runs = {torch.float32: f"{name}_fp32", torch.bfloat16: f"{name}_bf16"}
    dtype_of = {fixture: dtype for dtype, fixture in runs.items()}
    tols = {torch.float32: TOL["aten_cpu"], torch.bfloat16: TOL["diffsuite_bf16"]}
    per_dtype = pytest.mark.parametrize("run", list(runs.values()))

    def module_fixture(fixture_name, make):
        return pytest.fixture(scope="module", name=fixture_name)(lambda: make())

    if rows is None:
        def test_loads_the_builtin_state_dict_and_equals_it_eagerly():
            assert_eager_equals_builtin(from_builtin, state_of, eager_tol)
    else:
        @pytest.mark.parametrize("rows", rows)
        def test_loads_the_builtin_state_dict_and_equals_it_eagerly(rows):
            assert_eager_equals_builtin(from_builtin, state_of, eager_tol, rows)

    @pytest.mark.slow
    @per_dtype
    def test_compiled_equals_its_eager(run, request):
        assert_compiled_equals_eager(request.getfixturevalue(run), tols[dtype_of[run]])

    @pytest.mark.slow
    @per_dtype
    def test_lost_fusions_are_exactly_the_known_gaps(run, request, reference_plan):
        """Fails when a gap closes (or a new one opens): update LOST and the module docstring."""
        got = lost(reference_plan, per_layer(request.getfixturevalue(run)[2]))
        want = lost_by_dtype[dtype_of[run]]
        assert got == want, {"lost": got, "LOST": want}

    @pytest.mark.slow
    @pytest.mark.parametrize("pattern,dtype", diagnosed or ())
    def test_lost_fusions_have_a_near_miss(pattern, dtype, request):
        result = request.getfixturevalue(runs[dtype])
        assert_lost_where_near_missed(result, pattern, lost_by_dtype[dtype])

    namespace.update({
        "reference_plan": module_fixture("reference_plan", reference_plan),
        **{fixture: module_fixture(fixture, functools.partial(run, dtype, from_builtin, state_of))
           for dtype, fixture in runs.items()},
        "test_loads_the_builtin_state_dict_and_equals_it_eagerly":
            test_loads_the_builtin_state_dict_and_equals_it_eagerly,
        "test_compiled_equals_its_eager": test_compiled_equals_its_eager,
        "test_lost_fusions_are_exactly_the_known_gaps":
            test_lost_fusions_are_exactly_the_known_gaps,
    })
    if diagnosed is not None:
        namespace[near_miss_test] = test_lost_fusions_have_a_near_miss


def plan_with_rules_off(from_builtin, rules: tuple, probes: tuple = ()):
    """The fp32 plan per layer of the spelling (`probes` on) compiled with canonical `rules`
    disabled (none: as is), its step checked against its eager twin (TOL["aten_cpu"])."""
    ref = builtin(torch.float32)
    model, eager = (from_builtin(ref).set_probe(*probes) for _ in range(2))
    torch._dynamo.reset()
    step = torch.compile(model, backend="k3", fullgraph=True,
                         options={"executor": "aten", "keep_graphs": False,
                                  "disabled_rules": rules})
    assert steps(step, eager, n=1) <= TOL["aten_cpu"]
    return per_layer(last_compiled())
