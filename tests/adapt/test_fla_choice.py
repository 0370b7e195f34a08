"""Which fla Moonshot's files are imported against (`moonshot.fla_runs_on`): fla's own package only
for a model on a CUDA device, k3compile's torch stand-ins for a model on the CPU, fla installed or
not (fla's Triton kernels take no CPU tensors; on the H200, where fla imports, every CPU test of
tests/adapt once reached them).

fla is "installed" here by a fake package on sys.path whose entry points raise when called: a CPU
model built or loaded while it imports never reaches it and computes what the adapted step
computes; a CUDA model's class (`model_class(..., "cuda")`) is imported from it, in the same
process as the stand-ins' import, with one config class for both."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

from k3compile.adapt import adapt

REACHED = "fake fla reached"
FAKE = {  # module -> source: every name Moonshot's file imports from fla
    "fla/__init__.py": "",
    "fla/_reached.py": f"def reached(*args, **kwargs):\n    raise RuntimeError({REACHED!r})\n",
    "fla/modules/__init__.py": "from fla._reached import reached\n"
                               "class ShortConvolution:\n    __init__ = reached\n"
                               "class FusedRMSNormGated:\n    __init__ = reached\n",
    "fla/ops/__init__.py": "",
    "fla/ops/kda/__init__.py": "from fla._reached import reached as chunk_kda\n"
                               "from fla._reached import reached as fused_recurrent_kda\n",
    "fla/ops/utils/__init__.py": "",
    "fla/ops/utils/index.py": "from fla._reached import reached as prepare_cu_seqlens_from_mask\n"
                              "from fla._reached import reached as prepare_lens_from_mask\n",
    "fla/utils.py": "from fla._reached import reached\n"
                    "def tensor_cache(fn):  # a decorator at import: the function raises\n"
                    "    return reached\n",
}
PROMPT = torch.tensor([[5, 7, 9, 11], [3, 4, 5, 6]])


def _forget(prefixes):
    for name in [k for k in sys.modules if any(k == p or k.startswith(p + ".")
                                               for p in prefixes)]:
        del sys.modules[name]


@pytest.fixture
def fake_fla(moonshot, tmp_path, monkeypatch):
    """The fake fla importable (and no other fla imported) for the test; forgotten after, with
    the imports of Moonshot's files made against it."""
    for path, source in FAKE.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    for name in [k for k in sys.modules if k == "fla" or k.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield
    _forget(["fla", moonshot.FLA_PACKAGE])


def _config(moonshot):
    return moonshot.tiny_config(num_hidden_layers=2, mla_layers=(1,))  # KDA, then MLA


def _assert_runs_the_standins(model):
    """Moonshot's own prefill (its KDA layer through fla's entry points) equals the adapted
    step's, which never calls fla."""
    assert type(model).__module__.startswith("k3compile_moonshot.")
    want = model(input_ids=PROMPT).logits[:, -1]
    B = PROMPT.shape[0]
    got = adapt(model, max_batch=B, max_seq_len=8)(PROMPT, torch.zeros(B, dtype=torch.long),
                                                   torch.arange(B))[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fake_fla")
def test_cpu_models_never_reach_an_installed_fla(moonshot, tmp_path):
    from safetensors.torch import save_file

    assert moonshot.fla_runs_on("cuda") and not moonshot.fla_runs_on("cpu")
    model = moonshot.build(_config(moonshot))
    _assert_runs_the_standins(model)
    folder = tmp_path / "checkpoint"
    model.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    loaded = moonshot.from_pretrained(folder, dtype=torch.float32)
    _assert_runs_the_standins(loaded)
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in loaded.state_dict().items())


@pytest.mark.usefixtures("fake_fla")
def test_cuda_models_import_fla_beside_the_standins(moonshot):
    """A model for a CUDA device gets fla's own classes (constructing the fake's raises: the
    model would run fla's kernels); the stand-ins' import stays as it was."""
    standins = moonshot.load()
    own = moonshot.load(standins=False)
    assert own is not standins and own.ShortConvolution.__module__ == "fla.modules"
    assert standins.ShortConvolution.__module__ == "k3compile.adapt.fla"
    assert own.KimiLinearConfig is standins.KimiLinearConfig
    assert moonshot.model_class("kimi_linear", "cuda") is own.KimiLinearForCausalLM
    with pytest.raises(RuntimeError, match=REACHED), moonshot.compatible():
        moonshot.model_class("kimi_linear", "cuda")(_config(moonshot))
    assert moonshot.model_class("kimi_linear") is standins.KimiLinearForCausalLM
