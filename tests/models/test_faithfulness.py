"""The reference model against the naive float64 oracle (`naive_k3.py`), block by block and over
a multi-step decode whose KDA states and MLA caches evolve.

Blocks get identical inputs (the model's, cast to float64) and identical starting states, so the
fp32 tolerance only covers rounding. bf16 blocks use the same weights and a looser tolerance; the
whole model is compared in fp32 only, since bf16 noise flips near-tie top-k choices.
"""

from __future__ import annotations

import naive_k3 as nk
import pytest
import torch
from model_checks import TOL, assert_rel

from k3compile.math import depth_mix, e2m1_table, mxfp4_dequant, situ
from k3compile.models import build_model, get_config

DTYPES = [torch.float32, torch.bfloat16]
MAX_BATCH, MAX_LEN = 4, 32


def _tol(dtype: torch.dtype) -> float:
    return TOL[str(dtype).removeprefix("torch.")]


@pytest.fixture(scope="module", params=DTYPES, ids=["fp32", "bf16"])
def model(request):
    return build_model(get_config("tiny"), dtype=request.param, max_batch=MAX_BATCH,
                       max_seq_len=MAX_LEN)


@pytest.fixture(scope="module")
def weights(model):
    return nk.Weights(model.state_dict())


def _layers(model):
    return model.language_model.model.layers


def _pre(i: int) -> str:
    return f"language_model.model.layers.{i}."


def _randomise_states(model, seed: int = 0):
    """Non-zero decode state everywhere, as after some history."""
    gen = torch.Generator().manual_seed(seed)
    for layer in _layers(model):
        attn = layer.self_attn
        if layer.is_mla:
            rows = torch.randn(attn.kv_cache.shape, generator=gen)
            attn.kv_cache.copy_(rows)
        else:
            attn.conv_state.copy_(torch.randn(attn.conv_state.shape, generator=gen))
            state = torch.randn(attn.recurrent_state.shape, generator=gen)
            attn.recurrent_state.copy_(0.05 * state)


def _naive_states(model, cfg) -> dict[int, nk.State]:
    """The model's decode state of every slot, copied into the oracle's layout."""
    states = {}
    for slot in range(model.max_batch + 1):
        st = nk.State(cfg, MAX_LEN)
        for i, layer in enumerate(_layers(model)):
            attn = layer.self_attn
            if layer.is_mla:
                st.cache[i] = attn.kv_cache[slot].double().clone()
            else:
                st.conv[i] = attn.conv_state[slot].double().T.clone()
                st.S[i] = attn.recurrent_state[slot].double().clone()
        states[slot] = st
    return states


def _assert_states(model, states: dict[int, nk.State], slots, tol: float, what: str):
    for slot in slots:
        st = states[slot]
        for i, layer in enumerate(_layers(model)):
            attn = layer.self_attn
            where = f"{what}, slot {slot}, layer {i}"
            if layer.is_mla:
                assert_rel(attn.kv_cache[slot], st.cache[i], tol, where + " MLA cache")
            else:
                assert_rel(attn.conv_state[slot], st.conv[i].T, tol, where + " conv state")
                assert_rel(attn.recurrent_state[slot], st.S[i], tol, where + " KDA state")


def _x(shape, dtype, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------------------------------------
# the oracle's own MXFP4 decoder, and elementwise pieces


def test_naive_e2m1_decoder_by_hand():
    assert nk.E2M1.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    packed = torch.tensor([[0x7A] * 16], dtype=torch.uint8)  # low nibble 0xA = -1, high 7 = 6
    scale = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    w = nk.dequant_mxfp4(packed, scale)
    assert w[0, :4].tolist() == [-2.0, 12.0, -2.0, 12.0]


def test_model_dequant_matches_naive():
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (8, 64), generator=gen, dtype=torch.int32).to(torch.uint8)
    scale = torch.randint(110, 140, (8, 4), generator=gen, dtype=torch.int32).to(torch.uint8)
    got = mxfp4_dequant(packed, scale, e2m1_table(dtype=torch.float64))
    assert torch.equal(got, nk.dequant_mxfp4(packed, scale))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_situ(dtype):
    g = torch.linspace(-60, 60, 1001).to(dtype)
    u = torch.linspace(80, -80, 1001).to(dtype)
    assert_rel(situ(g, u, 4.0, 25.0), nk.situ(g.double(), u.double(), 4.0, 25.0), _tol(dtype))


# ---------------------------------------------------------------------------------------------
# blocks


@pytest.mark.parametrize("layer_idx", [1, 3, 4])  # n = 1 / 1 + bank write / 2 completed blocks
def test_attn_res_mix(model, weights, layer_idx):
    cfg, dtype = model.config, model.language_model.lm_head.weight.dtype
    layer = _layers(model)[layer_idx]
    n = -(-layer_idx // cfg.attn_res_block_size)
    B, T, D = 3, 2, cfg.hidden_size
    scales = torch.tensor([1.0, 4.0, 0.3])[: n + 1]
    sources = [(_x((B, T, D), dtype, seed=s) * scales[s]).to(dtype) for s in range(n + 1)]
    for norm, proj, name in (
        (layer.self_attention_res_norm, layer.self_attention_res_proj, "self_attention_res"),
        (layer.mlp_res_norm, layer.mlp_res_proj, "mlp_res"),
    ):
        got = depth_mix(sources[-1], sources[:-1], norm, proj)
        want = torch.empty(B, T, D, dtype=torch.float64)
        for b in range(B):
            for t in range(T):
                want[b, t] = nk.attn_res_mix(
                    [s[b, t].double() for s in sources],
                    weights(_pre(layer_idx) + name + "_norm.weight"),
                    weights(_pre(layer_idx) + name + "_proj.weight"), cfg.rms_norm_eps,
                )
        assert_rel(got, want, _tol(dtype), name)


def test_attn_res_mix_without_blocks_is_identity(model):
    layer = _layers(model)[0]
    x = _x((3, 1, model.config.hidden_size), torch.float32)
    assert depth_mix(x, [], layer.self_attention_res_norm, layer.self_attention_res_proj) is x


@pytest.mark.parametrize("layer_idx", [0, 2])
def test_kda_block(model, weights, layer_idx):
    cfg, dtype = model.config, model.language_model.lm_head.weight.dtype
    model.reset_cache()
    _randomise_states(model, seed=layer_idx)
    states = _naive_states(model, cfg)
    slots = torch.tensor([2, 0, 3])
    x = _x((3, 3, cfg.hidden_size), dtype)  # T = 3 verify rows: the recurrence runs in order
    got = _layers(model)[layer_idx].self_attn(x, slots)
    want = torch.empty(got.shape, dtype=torch.float64)
    for b, slot in enumerate(slots.tolist()):
        for t in range(x.shape[1]):
            want[b, t] = nk.kda_token(weights, _pre(layer_idx) + "self_attn.", x[b, t].double(),
                                      states[slot], layer_idx, cfg)
    assert_rel(got, want, _tol(dtype), "KDA output")
    _assert_states(model, states, range(MAX_BATCH + 1), _tol(dtype), "KDA block")


@pytest.mark.parametrize("layer_idx", [3, 5])
def test_mla_block(model, weights, layer_idx):
    cfg, dtype = model.config, model.language_model.lm_head.weight.dtype
    model.reset_cache()
    _randomise_states(model, seed=10 + layer_idx)
    states = _naive_states(model, cfg)
    slots, positions = torch.tensor([1, 3, 0]), torch.tensor([0, 7, 20])
    x = _x((3, 2, cfg.hidden_size), dtype)
    got = _layers(model)[layer_idx].self_attn(x, slots, positions)
    want = torch.empty(got.shape, dtype=torch.float64)
    for b, slot in enumerate(slots.tolist()):
        for t in range(x.shape[1]):
            pos = int(positions[b]) + t
            want[b, t] = nk.mla_token(weights, _pre(layer_idx) + "self_attn.", x[b, t].double(),
                                      states[slot], layer_idx, pos, cfg)
    assert_rel(got, want, _tol(dtype), "MLA output")
    _assert_states(model, states, range(MAX_BATCH + 1), _tol(dtype), "MLA block")


@pytest.mark.parametrize("layer_idx", [0, 1, 5])  # dense layer 0, MoE layers
def test_mlp_block(model, weights, layer_idx):
    cfg, dtype = model.config, model.language_model.lm_head.weight.dtype
    x = _x((3, 2, cfg.hidden_size), dtype, seed=layer_idx)
    got = _layers(model)[layer_idx].mlp(x)
    want = torch.empty(got.shape, dtype=torch.float64)
    for b in range(3):
        for t in range(2):
            fn = nk.moe_token if cfg.is_moe(layer_idx) else nk.mlp_token
            want[b, t] = fn(weights, _pre(layer_idx) + "mlp.", x[b, t].double(), cfg)
    assert_rel(got, want, _tol(dtype), "MLP output")


def test_router_picks_by_biased_score_weights_by_unbiased():
    cfg = get_config("tiny")
    model = build_model(cfg, dtype=torch.float32, max_batch=2, max_seq_len=8)
    gate = _layers(model)[1].mlp.gate
    x = _x((64, cfg.hidden_size), torch.float32, seed=3)
    scores = torch.sigmoid(x @ gate.weight.T)
    # push the experts that are usually least likely up, far enough to change most choices
    bias = torch.zeros(cfg.num_experts)
    bias[scores.mean(0).argsort()[: cfg.num_experts_per_token]] = 0.5
    gate.e_score_correction_bias.copy_(bias)
    idx, w = gate(x)

    W = nk.Weights(model.state_dict())
    pre = _pre(1) + "mlp."
    changed = 0
    for n in range(x.shape[0]):
        chosen, weights = nk.route(W, pre, x[n].double(), cfg)
        order = idx[n].argsort()
        got_idx = idx[n][order]
        want_order = torch.tensor(chosen).argsort()
        assert got_idx.tolist() == torch.tensor(chosen)[want_order].tolist(), f"token {n}"
        assert_rel(w[n][order], torch.tensor(weights, dtype=torch.float64)[want_order],
                   TOL["float32"], f"token {n} weights")
        # the weights are the unbiased scores of the chosen experts, renormalised
        unbiased = scores[n, idx[n]]
        assert torch.allclose(w[n], unbiased / unbiased.sum(), rtol=1e-5, atol=0)
        unbiased_choice = set(scores[n].topk(cfg.num_experts_per_token).indices.tolist())
        changed += set(chosen) != unbiased_choice
    assert changed > x.shape[0] // 2, "the bias should change most selections"


# ---------------------------------------------------------------------------------------------
# the whole model over several decode steps


STEPS = [1, 2, 1, 3, 1, 1]  # tokens per request per step; T > 1 are speculative verify rows


def _run_decode(dtype, steps, slots, start_positions, seed=0):
    """Decode with the model and the oracle side by side, yielding after each step."""
    cfg = get_config("tiny")
    model = build_model(cfg, dtype=dtype, max_batch=MAX_BATCH, max_seq_len=MAX_LEN)
    weights = nk.Weights(model.state_dict())
    states = _naive_states(model, cfg)  # all zero
    gen = torch.Generator().manual_seed(seed)
    positions = start_positions.clone()
    for step, T in enumerate(steps):
        ids = torch.randint(0, cfg.vocab_size, (len(slots), T), generator=gen)
        got = model(ids, positions, slots)
        want = nk.decode_step(weights, cfg, states, ids, positions, slots)
        yield step, model, states, got, want
        positions += T


def test_decode_matches_naive_fp32():
    slots, start = torch.tensor([2, 0, 1]), torch.tensor([0, 2, 5])
    tol = TOL["float32_decode"]
    for step, model, states, got, want in _run_decode(torch.float32, STEPS, slots, start):
        assert_rel(got, want, tol, f"step {step} logits")
        _assert_states(model, states, range(MAX_BATCH + 1), tol, f"step {step}")


def test_single_token_input_shape():
    cfg = get_config("tiny")
    model = build_model(cfg, dtype=torch.float32, max_batch=2, max_seq_len=8)
    ids = torch.tensor([5, 9])
    states = _naive_states(model, cfg)  # before the step writes the model's
    got = model(ids, torch.tensor([0, 0]))
    want = nk.decode_step(nk.Weights(model.state_dict()), cfg, states, ids.unsqueeze(1),
                          torch.tensor([0, 0]), torch.tensor([0, 1]))
    assert got.shape == (2, cfg.vocab_size)
    assert_rel(got, want.squeeze(1), TOL["float32"], "logits")


def test_padding_rows_only_touch_the_scratch_slot():
    """Rows that pad a batch point at `scratch_slot`: real slots evolve as without them, and
    slots outside the batch stay untouched."""
    cfg = get_config("tiny")
    model = build_model(cfg, dtype=torch.float32, max_batch=MAX_BATCH, max_seq_len=MAX_LEN)
    weights = nk.Weights(model.state_dict())
    states = _naive_states(model, cfg)
    scratch = model.scratch_slot
    slots = torch.tensor([1, scratch, 3, scratch])
    real = torch.tensor([0, 2])
    gen = torch.Generator().manual_seed(5)
    positions = torch.tensor([0, 0, 4, 0])
    tol = TOL["float32_decode"]
    for step, T in enumerate([1, 2, 1]):
        ids = torch.randint(0, cfg.vocab_size, (4, T), generator=gen)
        got = model(ids, positions, slots)
        want = nk.decode_step(weights, cfg, states, ids[real], positions[real], slots[real])
        assert_rel(got[real], want, tol, f"step {step} logits of real rows")
        _assert_states(model, states, [1, 3], tol, f"step {step}")
        for slot in (0, 2):  # never in the batch
            for layer in _layers(model):
                for buf in layer.self_attn.buffers():
                    if buf.dim() >= 3:
                        assert not buf[slot].any(), f"step {step}: slot {slot} was written"
        positions[real] += T
