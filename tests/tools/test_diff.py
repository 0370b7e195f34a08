"""`k3compile diff` on the tiny model: the counts it reports are the backend's counters, layers
broken on purpose show up as near misses with the failing condition, the HTML report names every
template, and the exit status follows the fusion contract.

One compile of a broken tiny model serves most tests: layer 1's post-attention norm lets an
intermediate escape the AttnRes pattern, layer 2's norm holds its eps as a tensor (the pattern's
check wants a compile-time float); layer 4 has layer 2's structure and stays intact.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import fx

from k3compile import backend, cli
from k3compile.models import build_model, get_config
from k3compile.models.k3 import RMSNorm
from k3compile.pipeline import STAGES
from k3compile.stages.contract import FINAL
from k3compile.tools import diff
from k3compile.tools.diff.layers import stream_info


class LeakyNorm(RMSNorm):
    """The normaliser also feeds the output: an intermediate with a consumer outside the pattern."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (h * r).to(x.dtype) + 1e-3 * r.to(x.dtype)


def broken_tiny():
    """The `--model` factory: (model, example inputs) with the batch marked dynamic."""
    model = build_model(get_config("tiny"), dtype=torch.bfloat16, max_batch=4, max_seq_len=32)
    layers = model.language_model.model.layers
    layers[1].post_attention_layernorm.__class__ = LeakyNorm
    layers[2].post_attention_layernorm.eps = torch.tensor(1e-5)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2,), generator=gen)
    positions, slots = torch.tensor([0, 5]), torch.arange(2)
    for t in (ids, positions, slots):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return model, (ids, positions, slots)


@pytest.fixture(scope="module")
def broken():
    report = diff.run(model=f"{__name__}:broken_tiny", stages=("input", "fuse"))
    compiled = backend.last_compiled()
    (bucket,) = report.buckets
    return report, bucket, compiled


def _misses(bucket, layer: int, family: str):
    return [m for m in bucket.layers[layer].near_misses if m.family == family]


def test_counts_are_the_backend_counters(broken):
    report, bucket, compiled = broken
    everywhere = [*bucket.layers.values(), bucket.outside]
    rewrites = compiled.observer.reports[bucket.bucket]
    assert Counter(h.pattern for L in everywhere for h in L.hits) == rewrites.counts
    engine = [m for L in everywhere for m in L.near_misses if m.source == "engine"]
    assert len(engine) == len(rewrites.near_misses)
    contract = compiled.contracts[bucket.bucket]
    # the model's final mix + norm is the contract's FINAL row and the report's outside row
    rows = {**bucket.layers, FINAL: bucket.outside}
    assert [lr.layer for lr in contract.layers] == [*bucket.layers, FINAL]
    for lr in contract.layers:
        mine = rows[lr.layer]
        assert +mine.fused == +lr.actual, lr.layer
        assert mine.expected == lr.expected and mine.shortfall == lr.shortfall
        assert mine.contract_template == lr.template
    assert report.met == contract.met is False and report.exit_code == 1
    graph = compiled.observer.graphs[bucket.bucket]
    assert sum(L.kernels_after for L in everywhere) == sum(map(diff.launches, graph.nodes))
    records = compiled.observer.records[bucket.bucket]
    assert [(r.name, r.ops_after) for r in bucket.stages] == [
        (r.name, sum(r.ops_after.values())) for r in records]
    assert report.guards == {b: str(g) for b, g in compiled.guards.items()}


def test_layers_fold_into_templates(broken):
    _, bucket, _ = broken
    by_layer = {i: t for t in bucket.templates for i in t.layers}
    assert by_layer[2] is by_layer[4]  # an eps held as a tensor leaves the structure alone
    assert len({id(by_layer[i]) for i in (0, 1, 2, 3, 5)}) == 5
    assert by_layer[4].representative == 4  # the intact one, fused as planned
    dev = {i: " | ".join(r) for i, r in bucket.deviations.items()}
    assert "first layer" in dev[0] and "last layer" in dev[5]
    assert "structure differs from" in dev[1] and "+1 add.Tensor" in dev[1]
    assert "fused differently" in dev[2] and "shortfall" in dev[2]
    assert 4 not in dev
    rep = bucket.layers[4]
    assert rep.kernels_after < rep.kernels_before
    assert rep.fused["attn_res_mix_norm"] == rep.fused["oproj_attn_res_mix_norm"] == 1


def test_escaping_intermediate_is_a_near_miss(broken):
    report, bucket, _ = broken
    # the leaky norm is the post-attention mix's RMSNorm; whichever norm-holding pattern reports
    # it (the mix, or plain rms_norm once the o_proj fold owns the post-attention slot), the
    # near miss must name that site and the escaping rsqrt
    misses = [m for m in bucket.layers[1].near_misses
              if m.module.endswith("layers.1.post_attention_layernorm")
              and m.reason.startswith("multiple_users") and "rsqrt" in m.reason]
    assert misses, [(m.family, m.module, m.reason) for m in bucket.layers[1].near_misses]
    assert misses[0].kind in diff.format_text(report, color=False)


def test_refused_eps_is_a_near_miss(broken):
    report, bucket, _ = broken
    misses = _misses(bucket, 2, "attn_res_mix_norm")
    assert misses and all(m.source == "engine" for m in misses)
    assert all(m.module.endswith("layers.2.post_attention_layernorm") for m in misses)
    assert all(m.reason.startswith("check refused: norm_eps is not a compile-time float")
               for m in misses)
    assert "check refused: norm_eps" in diff.format_text(report, color=False)


def test_html_names_every_template(broken, tmp_path):
    report, bucket, _ = broken
    index = diff.write_html(report, tmp_path / "html")
    text = index.read_text()
    for t in bucket.templates:
        assert f'id="{t.id}-{bucket.bucket}">{t.id} {t.name}' in text
        assert f"layer {t.representative} before" in text
        assert f"layer {t.representative} after" in text
    assert 'class="removed"' in text and 'class="new"' in text  # the text drawing marks both
    assert (tmp_path / "html" / f"stages_input_fuse_bucket{bucket.bucket}.diff").stat().st_size


def test_stage_diff(broken):
    _, bucket, compiled = broken
    d = bucket.stage_diff
    rows = {op: (a, b) for op, a, b in d.histogram}
    hits = Counter(h.op for L in [*bucket.layers.values(), bucket.outside] for h in L.hits)
    # the o_proj fusion consumes an attn_res_mix_norm op made earlier in the same stage
    made = hits["k3.attn_res_mix_norm"] - hits["k3.oproj_attn_res_mix_norm"]
    assert rows["k3.attn_res_mix_norm"] == (0, made)
    assert any(line.startswith("+") and "k3.attn_res_mix_norm" in line for line in d.unified)
    same = diff.stage_diff(bucket, compiled, "fuse", "fuse")
    assert same.histogram == [] and same.unified == []
    with pytest.raises(KeyError, match="recorded: input, normalize"):
        diff.stage_diff(bucket, compiled, "input", "no_such_stage")


def test_colour_only_when_asked(broken):
    report, _, _ = broken
    assert "\033[" not in diff.format_text(report, color=False)
    assert "\033[" in diff.format_text(report, color=True)


def test_cli_exit_status_follows_the_contract(tmp_path, capsys):
    argv = ["diff", "--config", "tiny", "--layers", "1", "--color", "never"]
    assert cli.main([*argv, "--html", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fusion contract: met (exit status 0)" in out
    assert (tmp_path / "index.html").exists()
    assert cli.main([*argv, "--disable", "rms_norm"]) == 1
    out = capsys.readouterr().out
    assert "fusion contract: NOT met (exit status 1)" in out
    assert "pattern disabled by options (disabled_patterns)" in out


# the streams and prefetch stages are not in yet: their ops, as the tool expects to find them
@torch.library.custom_op("k3difftest::prefetch_l2", mutates_args=())
def _prefetch_l2(w: torch.Tensor) -> None:
    pass


@torch.library.custom_op("k3difftest::stream_join", mutates_args=())
def _stream_join(x: torch.Tensor) -> None:
    pass


def test_streams_and_prefetch_points():
    g = fx.Graph()
    x, w = g.placeholder("arg0_1"), g.placeholder("arg1_1")
    prefetch = g.call_function(torch.ops.k3difftest.prefetch_l2.default, (w,))
    mm = g.call_function(torch.ops.aten.mm.default, (x, w))
    mm.meta["k3_stream"] = 1
    join = g.call_function(torch.ops.k3difftest.stream_join.default, (mm,))
    streams, sync, points = stream_info([prefetch, mm, join], {"arg1_1": "layers.1.w"})
    assert streams == Counter({("1", "mm"): 1})
    assert sync == ["k3difftest.stream_join @ ?"]
    assert [pf.text() for pf in points] == ["k3difftest.prefetch_l2 @ ?: 1 weights (layers.1.w)"]


def test_ops_left_unfused_on_the_device_are_reported(broken):
    report, bucket, _ = broken
    assert bucket.deferred == {}  # CPU: everything fuses, nothing to report
    assert "left unfused on this device" not in diff.format_text(report, color=False)
    shown = dataclasses.replace(bucket, deferred={"kda_decode": "no CUDA kernel yet"})
    text = diff.format_text(dataclasses.replace(report, buckets=[shown]), color=False)
    assert "left unfused on this device: kda_decode (no CUDA kernel yet)" in text


def test_verify_count_is_printed_in_verify_mode(broken):
    report, bucket, compiled = broken
    assert not compiled.options.verify and bucket.verified is None
    assert "verify:" not in diff.format_text(report, color=False)
    shown = dataclasses.replace(bucket, verified=(79, 1))
    text = diff.format_text(dataclasses.replace(report, buckets=[shown]), color=False)
    assert "verify: 79 rewrites verified, 1 reverted (each checked numerically" in text


def test_met_templates_do_not_list_their_near_misses(broken):
    report, bucket, _ = broken
    met = [t for t in bucket.templates
           if not any(bucket.layers[i].shortfall for i in t.layers)
           and any(bucket.layers[i].near_misses for i in t.layers)]
    assert met, "the broken model has a template that meets its plan and records near misses"
    text = diff.format_text(report, color=False)
    every = diff.format_text(report, color=False, near_misses="all")
    for t in met:
        block = text.split(f"--- {t.id} ")[1].split("\n---")[0]
        assert "recorded, none listed: the plan is met here" in block
        assert "e.g. layer" not in block
        assert "e.g. layer" in every.split(f"--- {t.id} ")[1].split("\n---")[0]
    short = bucket.layers[2]  # the refused eps: its template lists the misses
    assert short.shortfall and "check refused: norm_eps" in text


def test_observer_subscription_sees_every_stage():
    from k3compile.observe import Observer

    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.relu.default, (x,)))
    gm = fx.GraphModule(torch.nn.Module(), g)
    ctx = type("Ctx", (), {"batch": 4})()
    events = []
    obs = Observer()
    with Observer.subscribe(events.append):
        obs.run("a", lambda gm, ctx: gm, gm, ctx)
        obs.run("b", lambda gm, ctx: gm, gm, ctx)
    obs.run("c", lambda gm, ctx: gm, gm, ctx)  # after the block: no listener
    assert [(e.stage, e.record is None, e.first, e.batch) for e in events] == [
        ("a", True, True, 4), ("a", False, False, 4), ("b", True, False, 4), ("b", False, False, 4)]
    assert events[1].record is obs.records[4][0] and events[0].gm is gm
    assert Observer._listeners == []


# issue 22: every bad argument is one argparse error line (exit status 2), before any compile
@pytest.mark.parametrize(("argv", "message"), [
    (["--layers", "0"], "argument --layers: must be at least 1, got 0"),
    (["--layers", "99"], "--layers 99: config tiny has 6 layers"),
    (["--world-size", "0"], "argument --world-size: must be at least 1, got 0"),
    (["--option", "executor=foo"],
     "argument --option: executor must be 'inductor' or 'aten', got 'foo'"),
    (["--executor", "inductor", "--option", "executor=aten"],
     "--executor inductor contradicts --option executor=aten"),
    (["--option", "nope=1"], "argument --option: unknown k3 backend options ['nope']"),
    (["--option", "verify"], "argument --option: 'verify' is not KEY=VALUE"),
    (["--batch", "0"], "argument --batch: must be at least 1, got 0"),
    (["--batch", "two"], "argument --batch: 'two' is not an integer"),
    (["--batch", "100"], ("--batch 100 is above the largest bucket 64 (it would run uncompiled): "
                          "add a bucket with --option buckets=[...]")),
    (["--T", "0"], "argument --T: must be at least 1, got 0"),
    (["--dtype", "nope"], ("argument --dtype: invalid choice: 'nope' (choose from 'bfloat16', "
                           "'float16', 'float32')")),
    (["--option", "buckets=[1,x]"], ("argument --option: buckets=[1,x]: not a JSON list of "
                                     "positive batch sizes (e.g. buckets=[1,2,4])")),
    (["--option", "buckets=3"], ("argument --option: buckets=3: not a JSON list of positive "
                                 "batch sizes (e.g. buckets=[1,2,4])")),
    (["--option", "buckets=[]"], "argument --option: buckets must be positive batch sizes, got []"),
    (["--config", "nope"], ("--config nope: unknown config 'nope'; known: ['k3', 'k3_tp16', "
                            "'k3_tp8', 'small', 'tiny']")),
    (["--model", "nomodule"], "--model nomodule: wants module:factory, got 'nomodule'"),
    (["--stages", "input", "nope"], "--stages: unknown stage nope; the stages: "
                                    + ", ".join(["input", *(name for name, _ in STAGES)])),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["diff", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == f"k3compile diff: error: {message}"


TIMES = re.compile(r"\d+\.\d+ ?s\b")
SYMBOLS = re.compile(r"\bs\d+\b")  # Dynamo's batch symbol: its number is not the report's


def _normalised(lines: list[str]) -> list[str]:
    return [SYMBOLS.sub("s#", TIMES.sub("#s", line)) for line in lines]


def test_readme_sample_is_the_generated_report():
    """README's excerpt is the start of docs/diff_example.txt (regenerated by
    `python -m k3compile.diff --config tiny --batch 2 --color never > docs/diff_example.txt`),
    times aside."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    sample = readme.split("\n```\nk3compile diff: ", 1)[1].split("\n```", 1)[0]
    sample = ("k3compile diff: " + sample).splitlines()
    example = (root / "docs" / "diff_example.txt").read_text().splitlines()
    assert _normalised(sample) == _normalised(example[:len(sample)])


@pytest.mark.slow
def test_diff_example_is_what_the_command_prints(capsys):
    """docs/diff_example.txt (and so README's excerpt) is regenerated here with the command the
    README shows, times and the batch symbol's number aside (one tiny compile, ~30 s)."""
    root = Path(__file__).resolve().parents[2]
    example = (root / "docs" / "diff_example.txt").read_text().splitlines()
    assert cli.main(["diff", "--config", "tiny", "--batch", "2", "--color", "never"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert _normalised(printed) == _normalised(example)


@pytest.mark.slow  # the tiny model compiled at world size 1, then by two gloo ranks (~50 s)
def test_world_size_two_shows_the_sharded_graph():
    """`diff --world-size 2`: the ranks meet through the run's own FileStore (no port to race
    for) and rank 0's report holds the tensor-parallel graph: every o_proj's all-reduce fused with
    its mix and norm, where a world of one has no all-reduce and fuses o_proj with the mix; the
    depth mixes are the same in number."""
    def fused(report) -> Counter:
        return sum((layer.fused for layer in report.buckets[0].layers.values()), Counter())

    one, two = fused(diff.run(dtype="float32")), fused(diff.run(world_size=2, dtype="float32"))
    assert one["allreduce_attn_res_mix_norm"] == 0 and one["oproj_attn_res_mix_norm"] > 0
    assert two["oproj_attn_res_mix_norm"] == 0
    assert two["allreduce_attn_res_mix_norm"] >= one["oproj_attn_res_mix_norm"]
    mixes = ("attn_res_mix_norm", "oproj_attn_res_mix_norm", "allreduce_attn_res_mix_norm")
    assert sum(two[op] for op in mixes) == sum(one[op] for op in mixes)
