"""`moonshot.released_names`: the transformers names Moonshot's modeling_kimi_linear.py imports
mean under the installed transformers what they meant under 5.1.0 (its release's), and nothing
changes where transformers still has them:

1. `stand_ins` on transformers 5.1.0's layout (both names in `utils.generic`, no
   `utils.output_capturing`, the mask taking `cache_position`) is empty; on 5.17's it provides
   the moved `OutputRecorder` itself, `check_model_inputs` as both halves 5.2.0 split it into,
   and the mask with 5.1.0's keywords; the installed transformers' modules are restored after;
2. on Moonshot's model under the installed transformers (5.1.0 in CI; 5.17 on the H200 image):
   `output_hidden_states=True` returns the embeddings and every decoder layer's output (what
   `check_model_inputs` recorded under 5.1.0), `return_dict=False` a tuple, and the causal mask
   Moonshot's forward builds over its `KimiDynamicCache` is causal at the cache's positions.
"""

from __future__ import annotations

import types

import pytest
import torch

from k3compile.adapt import moonshot as loader
from tests.adapt.test_moonshot import PROMPT


def create_causal_mask_5_1(config, input_embeds, attention_mask, cache_position,
                           past_key_values, position_ids=None, or_mask_function=None,
                           and_mask_function=None):
    """transformers 5.1.0's signature (the body is never run)."""


def create_causal_mask_5_17(config, inputs_embeds, attention_mask, past_key_values,
                            position_ids=None, or_mask_function=None, and_mask_function=None,
                            block_sequence_ids=None, layer_idx=None, allow_is_causal_skip=True):
    """transformers 5.17's signature: returns what it was asked (its arguments)."""
    return {"inputs_embeds": inputs_embeds, "past_key_values": past_key_values,
            "layer_idx": layer_idx, "config": config, "attention_mask": attention_mask}


def test_no_stand_in_where_transformers_has_the_names(moonshot):
    generic = types.SimpleNamespace(OutputRecorder=object(), check_model_inputs=object())
    masking = types.SimpleNamespace(create_causal_mask=create_causal_mask_5_1)
    assert loader.stand_ins(generic, None, masking) == {}
    # the installed transformers: what Moonshot's module bound is transformers' own object
    # wherever no stand-in is due (all three names under 5.1.0)
    generic, capturing, masking = loader.transformers_modules()
    due = loader.stand_ins(generic, capturing, masking)
    code = moonshot.load()
    assert code.OutputRecorder is (generic if capturing is None else capturing).OutputRecorder
    assert (code.create_causal_mask is masking.create_causal_mask) == \
        ("create_causal_mask" not in due)
    if capturing is None:  # transformers < 5.2.0
        assert due == {}


def test_released_names_sets_the_due_names_only_and_restores_transformers():
    """Within the block exactly `stand_ins`' names differ in the installed transformers' modules
    (none under 5.1.0: the shim is a no-op there); after it, every module is as before."""
    pytest.importorskip("transformers", reason="transformers is not installed "
                        "(pip install -e '.[moonshot]')")
    modules = [m for m in loader.transformers_modules() if m is not None]
    due = loader.stand_ins(*loader.transformers_modules())
    before = [dict(vars(m)) for m in modules]
    with loader.released_names():
        inside = [dict(vars(m)) for m in modules]
    after = [dict(vars(m)) for m in modules]
    changed = {k for b, i in zip(before, inside, strict=True) for k in i if b.get(k) is not i[k]}
    assert changed == set(due)
    assert [b.keys() for b in before] == [a.keys() for a in after]
    assert all(a[k] is v for b, a in zip(before, after, strict=True) for k, v in b.items())


def test_stand_ins_where_transformers_moved_or_split_the_names():
    calls = []

    def merge(f):
        calls.append(("merge", f))
        return ("merged", f)

    def capture(f):
        calls.append(("capture", f))
        return ("captured", f)

    recorder = type("OutputRecorder", (), {})
    generic = types.SimpleNamespace(merge_with_config_defaults=merge,
                                    check_model_inputs=lambda f: ("merged only", f))
    capturing = types.SimpleNamespace(OutputRecorder=recorder, capture_outputs=capture)
    masking = types.SimpleNamespace(create_causal_mask=create_causal_mask_5_17)
    names = loader.stand_ins(generic, capturing, masking)
    assert set(names) == {"OutputRecorder", "check_model_inputs", "create_causal_mask"}
    assert names["OutputRecorder"] == (generic, "OutputRecorder", recorder)
    module, attribute, check = names["check_model_inputs"]
    assert (module, attribute) == (generic, "check_model_inputs")
    forward = object()
    assert check(forward) == ("merged", ("captured", forward))  # capture inside, merge outside
    assert calls == [("capture", forward), ("merge", ("captured", forward))]

    module, attribute, mask = names["create_causal_mask"]
    assert (module, attribute) == (masking, "create_causal_mask")

    class Cache:
        def get_mask_sizes(self, cache_position, layer_idx):
            return cache_position.shape[0] + 5, 0

        is_compileable = False

    x, positions, cache = torch.zeros(2, 3, 8), torch.arange(5, 8), Cache()
    seen = mask(config="c", input_embeds=x, attention_mask=None, cache_position=positions,
                past_key_values=cache, position_ids=None)
    assert seen["inputs_embeds"] is x and seen["config"] == "c"
    view = seen["past_key_values"]
    assert view.get_query_offset(0) == 5 and view.get_mask_sizes(3, 2) == (8, 0)
    assert view.is_compileable is False
    # a caller with 5.17's keywords passes through unchanged
    seen = mask("c", x, None, cache, layer_idx=1)
    assert seen["past_key_values"] is cache and seen["layer_idx"] == 1


@pytest.fixture(scope="module")
def model(moonshot):
    return moonshot.build(moonshot.tiny_config())


def test_output_hidden_states_and_return_dict_as_under_5_1(model):
    layers = model.model.layers
    recorded = []
    hooks = [layer.register_forward_hook(
        lambda m, a, out: recorded.append(out[0] if isinstance(out, tuple) else out))
        for layer in layers]
    try:
        with torch.no_grad():
            out = model(input_ids=PROMPT, use_cache=False, output_hidden_states=True)
    finally:
        for hook in hooks:
            hook.remove()
    hidden = out.hidden_states
    assert len(hidden) == len(layers) + 1
    assert torch.equal(hidden[0], model.model.embed_tokens(PROMPT))
    for got, want in zip(hidden[1:-1], recorded[:-1], strict=True):
        assert torch.equal(got, want)
    with torch.no_grad():
        plain = model(input_ids=PROMPT, use_cache=False)
        tupled = model.model(input_ids=PROMPT, use_cache=False, return_dict=False)
    assert plain.hidden_states is None
    assert torch.equal(out.logits, plain.logits)
    assert isinstance(tupled, tuple)
    assert torch.equal(model.lm_head(tupled[0]), plain.logits)


def test_causal_mask_over_moonshots_cache(moonshot, model):
    code = moonshot.load()
    config = model.config
    past, T, B = 3, 2, 2
    cache = code.KimiDynamicCache(config=config)
    for layer in cache.transformer_layers:
        kv = torch.zeros(B, 1, past, 4)
        cache.update(kv, kv, layer)
    x = torch.zeros(B, T, config.hidden_size)
    positions = torch.arange(past, past + T)
    mask = code.create_causal_mask(config=config, input_embeds=x, attention_mask=None,
                                   cache_position=positions, past_key_values=cache,
                                   position_ids=positions.unsqueeze(0))
    allowed = mask if mask.dtype == torch.bool else mask == 0
    want = torch.arange(past + T)[None, :] <= positions[:, None]  # [T, past + T]
    assert allowed.shape == (B, 1, T, past + T)
    assert torch.equal(allowed, want.expand(B, 1, T, past + T))
