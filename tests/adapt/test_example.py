"""examples/moonshot.py as a user runs it (a subprocess, CPU, the release's class, 3 tokens): it
prints tokens/s and the per-layer plan, and its compiled step's tokens are Moonshot's eager
greedy tokens, computed here from the same seeded model and prompt."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_example_tokens_are_moonshots_eager_greedy_tokens(moonshot):
    tokens = 3
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "moonshot.py"), "--model", "k3",
                          "--tokens", str(tokens)], capture_output=True, text=True, env=env,
                         timeout=600, cwd=ROOT, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines() if ": " in line)
    assert float(lines["moonshot eager"].split()[0]) > 0
    assert float(lines["adapted + k3"].split()[0]) > 0
    assert "layer template" in run.stdout and "kda_moe" in run.stdout  # the per-layer plan
    prompt = torch.tensor(ast.literal_eval(lines["prompt"]))
    got = ast.literal_eval(lines["tokens"])

    model = moonshot.build(moonshot.tiny_k3_config())
    out = model(input_ids=prompt, use_cache=True)
    ids, want = out.logits[:, -1].argmax(-1), []
    for _ in range(tokens):
        want.append(ids)
        ids = model(input_ids=ids[:, None], past_key_values=out.past_key_values,
                    use_cache=True).logits[:, -1].argmax(-1)
    assert got == torch.stack(want, 1).tolist()
