"""The fusion contract's warning names a near miss for every missing op of a layer, not only the
first: the blind spelling's layers missed linear_concat and oproj_attn_res_mix_norm, and the
warning named linear_concat's alone (the o_proj miss, a refused check, went unsaid). Of an op's
records a refused check is named first; a fusion built on another is explained by that one's."""

from __future__ import annotations

import collections
import types

from k3compile.rewrite import NearMiss
from k3compile.stages.contract import LayerReport, _why


def _layer(**missing) -> LayerReport:
    expected = {"rms_norm": 1, **missing}
    return LayerReport(2, "mla_moe", expected, collections.Counter({"rms_norm": 1}),
                       collections.Counter())


def _misses(*records) -> types.SimpleNamespace:
    return types.SimpleNamespace(near_misses=[NearMiss(p, "n", r, m) for p, r, m in records])


def test_each_missing_op_is_named_with_a_refused_check_first():
    report = _misses(
        ("linear_concat[mla]", "function_mismatch: mul_85 where the pattern expects view",
         "layers.2.mixer"),
        ("oproj_attn_res_mix_norm[blocks=8,prefix]", "multiple_users: a k3 op has 2 users",
         "layers.2.post_norm"),
        ("oproj_attn_res_mix_norm[blocks=2,new_block]",
         "check refused: o (mul_85) reads no state buffer", "layers.2.post_norm"),
        ("attn_res_mix_norm[blocks=2,delta]", "args_structure: another list length",
         "layers.2.post_norm"),
        ("oproj_attn_res_mix_norm[blocks=1,new_block]", "check refused: in another layer",
         "layers.3.post_norm"))
    text = _why(_layer(linear_concat=1, oproj_attn_res_mix_norm=1), report)
    assert "near miss linear_concat[mla]: function_mismatch: mul_85" in text
    assert "near miss oproj_attn_res_mix_norm[blocks=2,new_block]: check refused: o (mul_85)" \
        in text
    assert "another layer" not in text and "args_structure" not in text


def test_a_fusion_built_on_another_is_explained_by_its_misses():
    report = _misses(("kda_decode[T=1,B=n,float32]", "multiple_users: mul_8 has 2 users",
                      "layers.2.mixer"))
    assert "near miss kda_decode[T=1,B=n,float32]: multiple_users" in _why(
        _layer(fb_kda_decode=1), report)


def test_no_record_no_reason():
    assert _why(_layer(mla_decode=1), _misses()) == ""
