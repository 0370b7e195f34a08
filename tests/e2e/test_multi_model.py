"""Several K3 models in one process (issue 20 item 5): each compiled step equals its own eager
model and meets the fusion contract, whatever the configs.

A second model whose RMSNorm eps differs makes Dynamo recompile `forward` with every float
attribute lifted to a 0-d tensor input read by `.item()`; that graph serves every later model of
the class, so the backend bakes the floats back in per call and keys its steps by them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3compile import backend
from k3compile.models import build_model, get_config
from tests.conftest import TOL, rel_err

TINY = dataclasses.replace(get_config("tiny"), num_hidden_layers=2)
ONE_LAYER = dataclasses.replace(TINY, num_hidden_layers=1)  # MLA + dense MLP: half the compile


def _pair(cfg, seed=0):
    return [build_model(cfg, dtype=torch.float32, seed=seed, max_batch=4, max_seq_len=32)
            for _ in range(2)]


def _args(batch: int, pos: int, dynamic: bool):
    args = (torch.arange(batch) * 37 % 512 + pos, torch.full((batch,), pos), torch.arange(batch))
    if dynamic:
        for t in args:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    return args


def _check_models(cfgs, batch: int, dynamic: bool):
    torch._dynamo.reset()
    for cfg, seed in cfgs:
        model, eager = _pair(cfg, seed)
        step = torch.compile(model, backend="k3", fullgraph=True,
                             options={"executor": "aten", "buckets": (2, 4)})
        for pos in range(2):
            args = _args(batch, pos, dynamic)
            assert rel_err(step(*args), eager(*args)) <= TOL["aten_cpu"], (cfg.rms_norm_eps, pos)
        compiled = backend.last_compiled()
        assert compiled.contracts and all(r.met for r in compiled.contracts.values()), \
            compiled.summary()


def test_second_model_with_other_eps_and_dynamic_batch():
    _check_models([(ONE_LAYER, 0), (dataclasses.replace(ONE_LAYER, rms_norm_eps=0.05), 1)],
                  batch=2, dynamic=True)


@pytest.mark.slow
def test_three_configs_with_static_batch_each_get_their_own_step():
    """The third model reuses Dynamo's lifted-float graph: its eps must still be its own."""
    other = dataclasses.replace(TINY, rms_norm_eps=0.05, l2norm_eps=1e-3)
    third = dataclasses.replace(TINY, rms_norm_eps=0.2, situ_beta=2.0)
    _check_models([(TINY, 0), (other, 1), (third, 2), (TINY, 3)], batch=2, dynamic=False)
