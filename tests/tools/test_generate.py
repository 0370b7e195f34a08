"""`k3compile generate` on the tiny config (CPU): every backend's greedy tokens are a plain greedy
loop's over the eager model, the report has the timings, nothing compiles inside the timed steps,
and a backend that differs or recompiles is reported (exit status 1). Bad arguments are one
argparse line (exit status 2)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys

import pytest
import torch

from k3compile import cli
from k3compile.models import build_model, get_config
from k3compile.models.loader import save_checkpoint
from k3compile.tools import generate

ROW = re.compile(r"^(eager|inductor|k3)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+"
                 r"([\d.]+)\s+(\d+)$")


def greedy(model, prompt: list[int], batch: int, n: int) -> torch.Tensor:
    """The plain loop: one token per step, each request the same prompt, n tokens generated."""
    model.reset_cache()
    slots = torch.arange(batch)
    ids = torch.tensor(prompt).expand(batch, -1)
    out = []
    with torch.no_grad():
        for p in range(len(prompt) + n - 1):
            step_ids = ids[:, p].contiguous() if p < len(prompt) else out[-1]
            logits = model(step_ids, torch.full((batch,), p), slots)
            if p >= len(prompt) - 1:
                out.append(logits.argmax(-1))
    return torch.stack(out, 1)


def generate_cli(argv: list[str], tmp_path, capsys) -> tuple[int, str, dict]:
    path = tmp_path / "rows.json"
    code = cli.main(["generate", "--threads", "1", "--json", str(path), *argv])
    out = capsys.readouterr().out
    return code, out, json.loads(path.read_text())


def table_rows(out: str) -> dict[tuple[str, int], tuple[float, ...]]:
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m:
            rows[(m[1], int(m[2]))] = tuple(float(x) for x in m.groups()[2:])
    return rows


def tiny(layers: int | None = None, seed: int = 0):
    cfg = get_config("tiny")
    cfg = cfg.with_layers(layers) if layers else cfg
    model = build_model(cfg, dtype=torch.float32, max_batch=4, max_seq_len=64)
    return model.init_weights(seed) if seed else model


def test_eager_tokens_are_the_plain_greedy_loop(tmp_path, capsys):
    prompt = [5, 300, 17, 42]
    code, out, data = generate_cli(["--backends", "eager", "--layers", "2", "--batch", "1", "3",
                                    "--prompt-ids", "5,300,17,42", "--tokens", "6"],
                                   tmp_path, capsys)
    assert code == 0, out
    model = tiny(layers=2)
    for row in data["rows"]:
        want = greedy(model, prompt, row["batch"], 6)
        assert torch.equal(torch.tensor(row["tokens"]), want)
        assert row["recompiles"] == 0 and row["tokens_per_s"] > 0
        shown = table_rows(out)[("eager", row["batch"])]
        assert shown[0] == row["T"] == 1 and shown[1] == pytest.approx(row["tokens_per_s"], 0.01)
    assert "every backend produced eager's greedy tokens (6 per request)" in out


def test_verify_rows_reproduce_the_greedy_tokens(tmp_path, capsys):
    """T = 3: a prompt of 4 is left-padded to 6, prefilled 3 rows a step, then each step verifies
    3 draft tokens; the tokens are the one-row greedy loop's over the padded prompt."""
    code, out, data = generate_cli(["--backends", "eager", "--layers", "4", "--batch", "2",
                                    "--prompt", "K3!?", "--verify-rows", "3", "--tokens", "7"],
                                   tmp_path, capsys)
    assert code == 0, out
    (row,) = data["rows"]
    assert row["T"] == 3 and row["steps"] == 2  # 1 + 2 * 3 = 7 tokens
    want = greedy(tiny(layers=4), [0, 0, *b"K3!?"], 2, 7)
    assert torch.equal(torch.tensor(row["tokens"]), want)
    assert "prompt: 6 ids (left-padded to a multiple of T)" in out


class Wrong(torch.nn.Module):
    """A 'backend' whose logits favour another token from its `after`-th call on; `compile_at`:
    compile a new Dynamo graph at that call (a recompile inside the timed steps)."""

    def __init__(self, model, after: int | None = None, compile_at: int | None = None):
        super().__init__()
        self.model, self.after, self.compile_at, self.calls = model, after, compile_at, 0

    def forward(self, ids, positions, slots):
        self.calls += 1
        logits = self.model(ids, positions, slots)
        if self.compile_at is not None and self.calls >= self.compile_at:
            torch.compile(lambda x: x + 1, backend="eager")(torch.ones(self.calls))
        if self.after is not None and self.calls >= self.after:
            logits = logits.clone()
            logits[..., 7] = logits.max() + 1
        return logits

    def reset_cache(self):
        self.model.reset_cache()


@pytest.mark.parametrize("sabotage", ["tokens", "recompile"])
def test_a_backend_that_differs_or_recompiles_is_reported(sabotage, tmp_path, capsys,
                                                          monkeypatch):
    real = generate.make_step
    # the backend's calls: warm-up 1-6 (4 prompt + 2), timed decode 7-15 (4 prompt + 5)
    wrong = {"tokens": {"after": 12}, "recompile": {"compile_at": 14}}[sabotage]
    monkeypatch.setattr(generate, "make_step", lambda name, model, options: (
        Wrong(model, **wrong) if name == "inductor" else real(name, model, options)))
    code, out, data = generate_cli(["--backends", "eager,inductor", "--layers", "2",
                                    "--prompt-ids", "1,2,3,4", "--tokens", "6"], tmp_path, capsys)
    assert code == 1
    rows = {r["backend"]: r for r in data["rows"]}
    if sabotage == "tokens":
        assert "TOKENS DIFFER: inductor at batch 2:" in out and "request 0, token " in out
        assert rows["eager"]["tokens"] != rows["inductor"]["tokens"]
        assert rows["inductor"]["recompiles"] == 0
    else:
        assert rows["inductor"]["recompiles"] >= 1 and rows["eager"]["recompiles"] == 0
        assert "RECOMPILED inside the timed steps: inductor at batch 2" in out
        assert "every backend produced eager's greedy tokens" in out


def test_checkpoint_folder_with_its_config(tmp_path, capsys):
    """A folder saved from a 2-layer tiny variant (MLA at layer 1, other weights): config.json
    sets the architecture, the weights are the folder's, not the built-in seed's."""
    cfg = dataclasses.replace(get_config("tiny").with_layers(2), full_attn_layers=(1,))
    saved = build_model(cfg, dtype=torch.float32, max_batch=2, max_seq_len=64).init_weights(7)
    folder = tmp_path / "ckpt"
    save_checkpoint(saved, folder)
    (folder / "config.json").write_text(json.dumps(
        {"text_config": {"num_hidden_layers": 2, "full_attn_layers": [1]}}))
    code, out, data = generate_cli(["--checkpoint", str(folder), "--backends", "eager",
                                    "--prompt-ids", "9,8,7", "--tokens", "5"], tmp_path, capsys)
    assert code == 0, out
    assert "model: tiny, 2 layers (config.json: 2 fields)" in out
    got = torch.tensor(data["rows"][0]["tokens"])
    assert torch.equal(got, greedy(saved, [9, 8, 7], 2, 5))
    assert not torch.equal(got, greedy(tiny(layers=2), [9, 8, 7], 2, 5))


def test_plot_or_a_message(tmp_path, capsys, monkeypatch):
    rows = [generate.Row("eager", b, 1, 4, 0.01 * b, 0.0, 0, torch.zeros(b, 5), 6)
            for b in (1, 2)]
    png = tmp_path / "layers.png"
    if importlib.util.find_spec("matplotlib"):
        assert generate.plot(rows, str(png), "tiny") == f"plot: {png}"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert generate.plot(rows, str(tmp_path / "no.png"), "tiny").startswith(
        "matplotlib is not installed")
    assert not (tmp_path / "no.png").exists()


@pytest.mark.slow
def test_k3_tokens_equal_eager(tmp_path, capsys):
    """The README's kind of run, cut to 4 layers (every layer kind): eager and k3 (executor aten,
    verify mode) at batch 3 (padded to bucket 4), plain decode; k3's tokens are the plain greedy
    loop's, and verify mode's count is printed."""
    code, out, data = generate_cli(["--backends", "eager,k3", "--option", "executor=aten",
                                    "--option", "verify=true", "--layers", "4", "--batch", "3", "--prompt-ids", "3,1,4,1",
                                    "--tokens", "5"], tmp_path, capsys)
    assert code == 0, out
    want = greedy(tiny(layers=4), [3, 1, 4, 1], 3, 5)
    rows = {r["backend"]: r for r in data["rows"]}
    for name in ("eager", "k3"):
        assert torch.equal(torch.tensor(rows[name]["tokens"]), want), name
        assert rows[name]["recompiles"] == 0
        tokens_per_s, ms_per_step = table_rows(out)[(name, 3)][1:3]
        assert tokens_per_s > 0 and ms_per_step > 0
    assert "k3: compiling batch 3 (T=1, executor aten) ..." in out
    assert re.search(r"k3: batch 3 ready in [\d.]+ s: 1 Dynamo graph\(s\), 1 k3 bucket", out)
    assert "every backend produced eager's greedy tokens" in out
    verified = re.search(r"^k3: verify: (\d+) rewrites verified, 0 reverted$", out, re.M)
    assert verified and int(verified[1]) > 0, out


@pytest.mark.slow
def test_warm_start_restores_the_step_in_the_next_run(tmp_path):
    """`--warm-start` twice on one pair of cache folders: the second run traces no Dynamo graph
    (every k3 graph restored) and decodes the plain greedy loop's tokens."""
    import os
    import subprocess

    env = {**os.environ, "K3_QUIET": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind"),
           "K3_CACHE_DIR": str(tmp_path / "k3")}
    env.pop("TORCH_CACHING_PRECOMPILE", None)  # the flag alone turns it on
    runs = []
    for i in range(2):
        path = tmp_path / f"run{i}.json"
        done = subprocess.run(
            [sys.executable, "-m", "k3compile.cli", "generate", "--backends", "k3", "--layers", "4",
             "--batch", "1", "2", "--prompt-ids", "3,1,4,1", "--tokens", "4", "--threads", "1",
             "--warm-start", "--json", str(path)],
            env=env, capture_output=True, text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        runs.append((done.stdout, json.loads(path.read_text())))
    (cold, _), (warm, data) = runs
    saved = re.search(r"warm start: 0 graph\(s\) restored without a Dynamo trace, (\d+) saved", cold)
    assert saved and int(saved[1]) > 0, cold
    assert f"warm start: {saved[1]} graph(s) restored" in warm, warm
    assert re.findall(r"ready in [\d.]+ s: (\d+) Dynamo graph", warm) == ["0", "0"], warm
    for row in data["rows"]:
        want = greedy(tiny(layers=4), [3, 1, 4, 1], row["batch"], 4)
        assert torch.equal(torch.tensor(row["tokens"]), want)


@pytest.mark.parametrize(("argv", "message"), [
    (["--batch", "0"], "argument --batch: must be at least 1, got 0"),
    (["--verify-rows", "0"], "argument --verify-rows: must be at least 1, got 0"),
    (["--tokens", "x"], "argument --tokens: 'x' is not an integer"),
    (["--backends", "eager,foo"],
     "argument --backends: unknown backend foo; the backends: eager, inductor, k3"),
    (["--prompt-ids", "1,x"], "argument --prompt-ids: '1,x' is not a comma-separated list of ids"),
    (["--prompt-ids", "1,9999"], "prompt ids must be in [0, 512) for config tiny"),
    (["--prompt", "a", "--prompt-ids", "1"],
     "argument --prompt-ids: not allowed with argument --prompt"),
    (["--config", "nope"], ("--config nope: unknown config 'nope'; known: ['k3', 'k3_tp16', "
                            "'k3_tp8', 'small', 'tiny']")),
    (["--layers", "9"], "--layers 9: config tiny has 6 layers"),
    (["--option", "executor=foo"],
     "argument --option: executor must be 'inductor' or 'aten', got 'foo'"),
    (["--device", "cpu", "--batch", "100"],
     ("--batch 100 is above the largest bucket 64 (it would run uncompiled): add a bucket with "
      "--option buckets=[...]")),
    (["--checkpoint", "/nonexistent"], "--checkpoint /nonexistent: not a folder"),
    (["--checkpoint", "/", "--prompt", "hi"],
     ("--prompt TEXT uses the byte tokenizer of the built-in configs; give a checkpoint's token "
      "ids with --prompt-ids")),
    (["--device", "tpu"], "argument --device: 'tpu': want cpu or cuda (cuda:N)"),
    (["--backends", "inductor,k3", "--warm-start"],
     ("--warm-start compiles the model's forward under k3 only (torch keys a saved package by "
      "the function, not the backend): drop inductor from --backends")),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == f"k3compile generate: error: {message}"


def test_byte_tokenizer_round_trip():
    text = "K3 décode ✓"
    ids = generate.byte_encode(text)
    assert max(ids) < 256 and generate.byte_decode(ids) == text
    assert generate.byte_decode([*b"ab", 300, *b"c"]) == "ab<300>c"
