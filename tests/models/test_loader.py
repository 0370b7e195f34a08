"""Checkpoints: the released HF names on disk, exact round trips, and tensor-parallel slices that
follow `../shared/k3_arch.md` §4.2."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open

from k3compile.math import e2m1_table, mxfp4_dequant
from k3compile.models import build_model, get_config
from k3compile.models.loader import load_checkpoint, save_checkpoint, shard_state_dict

CFG = get_config("tiny")
E, INTER, L = CFG.num_experts, CFG.moe_intermediate_size, CFG.routed_expert_hidden_size
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def full():
    return build_model(CFG, dtype=torch.bfloat16, max_batch=2, max_seq_len=8)


@pytest.fixture(scope="module")
def ckpt(full, tmp_path_factory):
    directory = tmp_path_factory.mktemp("k3_tiny")
    save_checkpoint(full, directory, shard_bytes=1 << 20)
    return directory


def _read_all(directory) -> dict[str, torch.Tensor]:
    index = json.loads((directory / INDEX).read_text())
    out = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(str(directory / fname), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                assert index["weight_map"][name] == fname
                out[name] = f.get_tensor(name)
    return out


def test_checkpoint_uses_released_names(full, ckpt):
    tensors = _read_all(ckpt)
    index = json.loads((ckpt / INDEX).read_text())
    assert set(index["weight_map"]) == set(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["metadata"]["total_size"] == nbytes
    assert len(set(index["weight_map"].values())) > 1, "1 MiB shards: the tiny model needs several"

    pre = "language_model.model.layers.1.block_sparse_moe.experts."
    assert tensors[pre + "3.w2.weight_packed"].shape == (L, INTER // 2)
    assert tensors[pre + "3.w2.weight_scale"].shape == (L, INTER // 32)
    assert tensors[pre + "3.w1.weight_packed"].shape == (INTER, L // 2)
    assert tensors[pre + "15.w3.weight_scale"].shape == (INTER, L // 32)
    assert tensors[pre + "3.w1.weight_packed"].dtype == torch.uint8
    stacked = full.language_model.model.layers[1].mlp.experts
    for proj, part, attr in (("w1", "packed", stacked.w1_packed), ("w2", "scale", stacked.w2_scale),
                             ("w3", "packed", stacked.w3_packed)):
        assert torch.equal(tensors[f"{pre}7.{proj}.weight_{part}"], attr[7])
    assert not any(".experts.w" in n for n in tensors), "stacked expert names leaked"

    a_log = tensors["language_model.model.layers.0.self_attn.A_log"]
    heads = CFG.kda_num_heads
    assert a_log.shape == (128,) and a_log.dtype == torch.float32
    assert torch.equal(a_log[:heads], full.language_model.model.layers[0].self_attn.A_log)
    assert not a_log[heads:].any()

    params = dict(full.named_parameters())
    for name, p in params.items():  # everything else verbatim, MoE layers under Moonshot's name
        if ".experts." not in name and not name.endswith("A_log"):
            moe = CFG.is_moe(int(name.split("layers.")[1].split(".")[0])) if "layers." in name \
                else False
            saved = name.replace(".mlp.", ".block_sparse_moe.") if moe else name
            assert torch.equal(tensors[saved], p), name
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in tensors  # dense: `mlp.`
    assert "language_model.model.layers.2.block_sparse_moe.gate.e_score_correction_bias" in tensors
    assert not any(".mlp." in n for n in tensors if ".layers.0." not in n)
    moe_layers = sum(CFG.is_moe(i) for i in range(CFG.num_hidden_layers))
    assert len(tensors) == len(params) + moe_layers * 6 * (E - 1)
    assert "language_model.lm_head.weight" in tensors
    assert "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in tensors


def test_a_log_per_head_round_trips(full, tmp_path):
    """`pad_a_log=False` writes A_log [heads] (Moonshot's parameter shape); it loads back."""
    save_checkpoint(full, tmp_path, pad_a_log=False)
    a_log = _read_all(tmp_path)["language_model.model.layers.1.self_attn.A_log"]
    assert torch.equal(a_log, full.language_model.model.layers[1].self_attn.A_log)
    fresh = build_model(CFG, dtype=torch.bfloat16, seed=1, max_batch=2, max_seq_len=8)
    load_checkpoint(fresh, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), fresh.parameters(),
                                                   strict=True))


def test_round_trip_gives_identical_logits(full, ckpt):
    fresh = build_model(CFG, dtype=torch.bfloat16, seed=1, max_batch=2, max_seq_len=8)
    load_checkpoint(fresh, ckpt)
    for (name, a), (_, b) in zip(full.named_parameters(), fresh.named_parameters(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    ids, pos = torch.tensor([[3, 7], [11, 400]]), torch.tensor([0, 2])
    full.reset_cache()
    assert torch.equal(fresh(ids, pos), full(ids, pos))


# What each tensor of a TP rank holds, from the spec's §4.2 table: the split dim, None = replicated.
# Written out by hand so a wrong rule in the loader cannot agree with itself.
EXPECTED_SPLIT = {
    "model.embed_tokens.weight": None,
    "lm_head.weight": 0,
    "model.norm.weight": None,
    "model.output_attn_res_norm.weight": None,
    "model.output_attn_res_proj.weight": None,
    **{f"model.layers.0.{n}.weight": None for n in (
        "self_attention_res_norm", "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj",
        "input_layernorm", "post_attention_layernorm")},
    # KDA
    **{f"model.layers.0.self_attn.{n}": 0 for n in (
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight", "b_proj.weight",
        "f_b_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "dt_bias",
        "A_log")},
    "model.layers.0.self_attn.f_a_proj.weight": None,
    "model.layers.0.self_attn.o_norm.weight": None,
    "model.layers.0.self_attn.o_proj.weight": 1,
    # dense layer-0 MLP
    "model.layers.0.mlp.gate_proj.weight": 0,
    "model.layers.0.mlp.up_proj.weight": 0,
    "model.layers.0.mlp.down_proj.weight": 1,
    # Gated MLA
    "model.layers.3.self_attn.q_a_proj.weight": None,
    "model.layers.3.self_attn.q_a_layernorm.weight": None,
    "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": None,
    "model.layers.3.self_attn.kv_a_layernorm.weight": None,
    "model.layers.3.self_attn.q_b_proj.weight": 0,
    "model.layers.3.self_attn.kv_b_proj.weight": 0,
    "model.layers.3.self_attn.g_proj.weight": 0,
    "model.layers.3.self_attn.o_proj.weight": 1,
    # LatentMoE
    "model.layers.3.mlp.gate.weight": None,
    "model.layers.3.mlp.gate.e_score_correction_bias": None,
    "model.layers.3.mlp.routed_expert_down_proj.weight": None,
    "model.layers.3.mlp.routed_expert_norm.weight": None,
    "model.layers.3.mlp.routed_expert_up_proj.weight": None,
    "model.layers.3.mlp.shared_experts.gate_proj.weight": 0,
    "model.layers.3.mlp.shared_experts.up_proj.weight": 0,
    "model.layers.3.mlp.shared_experts.down_proj.weight": 1,
    "model.layers.3.mlp.experts.w1_packed": 1,  # [E, I, L/2]: the intermediate rows
    "model.layers.3.mlp.experts.w1_scale": 1,
    "model.layers.3.mlp.experts.w3_packed": 1,
    "model.layers.3.mlp.experts.w3_scale": 1,
    "model.layers.3.mlp.experts.w2_packed": 2,  # [E, L, I/2]: the intermediate columns
    "model.layers.3.mlp.experts.w2_scale": 2,
}


@pytest.fixture(scope="module")
def tp_models(ckpt):
    models = []
    for rank in range(2):
        m = build_model(CFG.with_tp(2), dtype=torch.bfloat16, seed=9, max_batch=2, max_seq_len=8)
        models.append(load_checkpoint(m, ckpt, rank=rank))
    return models


def test_tp2_load_matches_shard_state_dict(full, tp_models):
    sd = full.state_dict()
    for rank, model in enumerate(tp_models):
        want = shard_state_dict(sd, model.config, rank)
        for name, p in model.named_parameters():
            assert torch.equal(p, want[name]), f"rank {rank}: {name}"


def test_tp2_slices_follow_the_spec(full, tp_models):
    params = dict(full.named_parameters())
    ranks = [dict(m.named_parameters()) for m in tp_models]
    for short, dim in EXPECTED_SPLIT.items():
        name = "language_model." + short
        f, parts = params[name], [r[name] for r in ranks]
        if dim is None:
            assert all(torch.equal(p, f) for p in parts), f"{short} should be replicated"
        else:
            assert parts[0].shape[dim] * 2 == f.shape[dim], f"{short} should split dim {dim}"
            assert torch.equal(torch.cat(parts, dim), f), short
    # every tensor of the model is covered by the table, modulo layer index
    seen = {n.split("layers.")[-1].split(".", 1)[-1] for n in EXPECTED_SPLIT}
    for name in params:
        assert name.split("layers.")[-1].split(".", 1)[-1] in seen or "layers." not in name, name


def test_tp2_expert_slices_dequantise_consistently(full, tp_models):
    """A rank's w2 packed and scale columns cover the same inputs: dequantising each rank's slice
    and concatenating along the input dim gives the full expert."""
    lut = e2m1_table(dtype=torch.float64)
    full_exp = full.language_model.model.layers[2].mlp.experts
    want = mxfp4_dequant(full_exp.w2_packed, full_exp.w2_scale, lut)  # [E, L, I]
    parts = []
    for m in tp_models:
        exp = m.language_model.model.layers[2].mlp.experts
        assert exp.w2_packed.shape == (E, L, INTER // 2 // 2)
        assert exp.w2_scale.shape == (E, L, INTER // 2 // 32)
        parts.append(mxfp4_dequant(exp.w2_packed, exp.w2_scale, lut))
    assert torch.equal(torch.cat(parts, -1), want)


def test_a_log_slices_by_head(full, tp_models):
    heads = CFG.kda_num_heads
    f = full.language_model.model.layers[1].self_attn.A_log
    for rank, m in enumerate(tp_models):
        got = m.language_model.model.layers[1].self_attn.A_log
        assert torch.equal(got, f[rank * heads // 2:(rank + 1) * heads // 2])


def test_missing_tensor_raises(full, tmp_path):
    save_checkpoint(full, tmp_path, shard_bytes=1 << 20)
    index = json.loads((tmp_path / INDEX).read_text())
    gone = "language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight_scale"
    del index["weight_map"][gone]
    (tmp_path / INDEX).write_text(json.dumps(index))
    with pytest.raises(KeyError, match=gone.replace(".", r"\.")):
        load_checkpoint(build_model(CFG, max_batch=1, max_seq_len=4), tmp_path)


def test_shape_mismatch_raises(ckpt):
    wider = dataclasses.replace(CFG, vocab_size=1024)
    with pytest.raises(ValueError, match="embed_tokens.*shape"):
        load_checkpoint(build_model(wider, max_batch=1, max_seq_len=4), ckpt)


def test_tp_size_and_rank_are_checked(ckpt):
    model = build_model(CFG.with_tp(2), max_batch=1, max_seq_len=4)
    with pytest.raises(ValueError, match="tp_size"):
        load_checkpoint(model, ckpt, rank=0, tp_size=4)
    with pytest.raises(ValueError, match="rank"):
        load_checkpoint(model, ckpt, rank=2)


def test_single_file_checkpoint(full, tmp_path):
    save_checkpoint(full, tmp_path)  # default shard size: one file
    (files,) = [p for p in tmp_path.iterdir() if p.suffix == ".safetensors"]
    files.rename(tmp_path / "model.safetensors")
    (tmp_path / INDEX).unlink()
    fresh = load_checkpoint(build_model(CFG, seed=2, max_batch=1, max_seq_len=4), tmp_path)
    for (name, a), (_, b) in zip(full.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(a, b), name
