"""The release's KDA A_log, stored zero-padded to 128 entries, loads into Moonshot's
`KimiDeltaAttention` (A_log [num_heads]) through `moonshot.from_pretrained`
(k3compile/adapt/padded.py): the loaded model equals the one that wrote the checkpoint; a nonzero
padding is refused."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")

from tests.adapt.test_moonshot import moonshot_greedy, rel
from tests.adapt.test_mxfp4_load import write_checkpoint

PAD = 128


def _pad_a_log(path, fill: float = 0.0) -> int:
    """Rewrite the checkpoint's A_log tensors padded to PAD entries (`fill` in the padding);
    how many."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    state = load_file(str(file))
    names = [n for n in state if n.endswith(".A_log")]
    for name in names:
        t = state[name]
        padded = t.new_full((PAD,), fill)
        padded[: t.numel()] = t
        state[name] = padded
    save_file(state, str(file), metadata={"format": "pt"})
    return len(names)


@pytest.fixture(scope="module")
def written(moonshot, tmp_path_factory):
    config = moonshot.tiny_config(num_hidden_layers=2, mla_layers=(1,))
    model = moonshot.build(config, dtype=torch.bfloat16)
    path = write_checkpoint(tmp_path_factory.mktemp("padded"), model, "mxfp4")
    return model, path


def test_a_padded_a_log_loads_per_head(moonshot, written, tmp_path):
    model, path = written
    padded = tmp_path / "ck"
    padded.mkdir()
    for f in path.iterdir():
        (padded / f.name).write_bytes(f.read_bytes())
    assert _pad_a_log(padded) == 1  # layer 0 is KDA, layer 1 MLA
    loaded = moonshot.from_pretrained(padded)
    kda = loaded.model.layers[0].self_attn
    want = model.model.layers[0].self_attn.A_log
    assert kda.A_log.shape == want.shape and torch.equal(kda.A_log, want)
    assert isinstance(kda.A_log, torch.nn.Parameter)
    unpadded = moonshot.from_pretrained(path)
    got, ref = moonshot_greedy(loaded, steps=2), moonshot_greedy(unpadded, steps=2)
    assert all(rel(g, w) == 0.0 for g, w in zip(got, ref, strict=True))
    # the class is left as it was: a model built afterwards has A_log per head
    assert moonshot.build(model.config).model.layers[0].self_attn.A_log.shape == want.shape


def test_a_nonzero_padding_is_refused(moonshot, written, tmp_path):
    _, path = written
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    _pad_a_log(tmp_path, fill=0.5)
    with pytest.raises(ValueError, match="nonzero padding"):
        moonshot.from_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())  # the folder is left as it was
