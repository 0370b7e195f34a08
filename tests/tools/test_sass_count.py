"""benchmarks/sass_count.py: the hot phase and its counts on a hand-written SASS listing, and on
a real build (FC2 with one 32-weight vector per thread) against the counts of `decode_dot`
worked out by hand from its source."""

import pytest

from tests.conftest import load_benchmark

sc = load_benchmark("sass_count")

# z staged, a barrier, then the dot of one vector (2 LDS, 4 FFMA, 3 integer), the warp sum
# (SHFL, FADD, not cut: only block-wide boundaries and epilogue instructions end the phase),
# then the epilogue (MUFU ends the phase) and EXIT's trap
LISTING = """
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0010*/                   FMUL R4, R4, 7.9228162514264337594e+28 ;
        /*0020*/                   STS.128 [R0], R4 ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   LDS.128 R8, [R1] ;
        /*0050*/                   LOP3.LUT R12, R5, 0x80008000, RZ, 0xc0, !PT ;
        /*0060*/                   IMAD.SHL.U32 R13, R12, 0x10000, RZ ;
        /*0070*/                   FFMA R14, R13, R8, RZ ;
        /*0080*/                   LDS.128 R8, [R1+0x10] ;
        /*0090*/               @P0 SHF.R.U32.HI R15, RZ, 0x6, R5 ;
        /*00a0*/                   FFMA R14, R15, R9, R14 ;
        /*00b0*/                   FFMA R14, R12, R10, R14 ;
        /*00c0*/                   FFMA R14, R14, R11, RZ ;
        /*00d0*/                   SHFL.BFLY PT, R16, R14, 0x10, 0x1f ;
        /*00e0*/                   FADD R14, R14, R16 ;
        /*00f0*/                   MUFU.EX2 R17, R14 ;
.L_x_1:
        /*0100*/                   FFMA R17, R17, R17, R17 ;
        /*0110*/               @P1 BRA `(.L_x_1) ;
        /*0120*/                   EXIT ;
.L_x_2:
        /*0130*/                   BRA `(.L_x_2);
"""


def test_hot_phase_of_a_listing():
    r = sc.count(LISTING, ptx=False, weights=4, per_vector=4)
    hot = r["hot"]
    assert r["instructions"] == 20 and hot["first"] == 4 and hot["count"] == 11
    assert hot["mix"] == {"lds": 2, "int": 2, "imad": 1, "ffma": 4, "other": 1, "fp": 1}
    assert hot["opcodes"]["LOP3.LUT"] == 1 and hot["opcodes"]["SHF.R.U32.HI"] == 1
    assert r["per_vector"] == 11 and r["per_weight"] == 2.75
    assert r["per_weight_mix"]["ffma"] == 1.0 and r["per_weight_mix"]["lds"] == 0.5
    # one real loop (the FFMA and its branch back); the trap after EXIT is not one
    assert [(lp["first"], lp["last"]) for lp in r["loops"]] == [(16, 17)]


@pytest.mark.dsl
def test_fc2_one_vector_matches_decode_dot(monkeypatch):
    """FC2 at L 64, I 32, top-1: each thread decodes one 16-byte vector (4 words, 16 nibble
    pairs) with `decode_dot`. Per pair: sign and magnitude masks, their or, the two halves
    (<< 16, & 0xFFFF0000), two FMAs; per word the pair shifts (12, 8, 4, 0) fold with the
    >> 6 into shl 12, shl 6 | shl 8, shl 2 | shl 4, shr 2 | shr 6. So in PTX: and 3·16, or 16,
    shl 4·5 + 16, shr 4·2, fma 32 + 1 (the E8M0 factor), 8 ld.shared.v4 (32 fp32 inputs)."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    _, build, weights, per_vector = sc.moe_case("fc2", 1, latent=64, inter=32, top_k=1)
    assert (weights, per_vector) == (32, 32)
    r = sc.measure(build, weights, per_vector, tool=None)  # PTX: no disassembler needed
    ops = r["hot"]["opcodes"]
    assert r["isa"] == "ptx" and r["frame"] == 0 and 0 < r["regs"] <= 255
    assert ops["and.b32"] == 48 and ops["or.b32"] == 16 and ops["shr.u32"] == 8
    assert ops["shl.b32"] - 36 in (0, 1)  # at most one of them addresses the staged row
    assert ops["fma.rn.f32"] == 33 and ops["ld.shared.v4.b32"] == 8
    assert not {"ldg", "st"} & set(r["hot"]["mix"]), "the weights load before the barrier"
    assert r["per_vector"] == r["hot"]["count"]
    if tool := sc.disassembler():  # ptxas merges logic into LOP3: never more, same FFMAs
        s = sc.measure(build, weights, per_vector, tool)
        mix = s["hot"]["mix"]
        assert s["isa"] == "sass" and s["hot"]["opcodes"]["FFMA"] == 33
        assert s["hot"]["opcodes"]["LDS.128"] == 8
        assert mix["int"] + mix.get("imad", 0) <= r["hot"]["mix"]["int"]


@pytest.mark.dsl
def test_decode_probe_repacked_saves_four_per_word(monkeypatch):
    """benchmarks/decode_bits.py's probe, one vector per thread. Per word (8 weights), PTX:
    `decode_dot` and 12, or 4, shl 9, shr 2; the repacked decode and 10, or 2, shl 8, shr 1
    (views: q & MASK; (q << 3) & MASK; two of (q << a) & SIGN | (q <</>> b) & MAG; then the
    halves: << 16, & 0xFFFF0000). Two shl address the rows. In SASS, 4 fewer per word."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    want = {"current": (48, 16, 36, 8), "repacked": (40, 8, 32, 4)}
    got = {}
    for variant, (n_and, n_or, n_shl, n_shr) in want.items():
        _, build, weights, per_vector = sc.case(f"decode:{variant}")
        ops = sc.measure(build, weights, per_vector, tool=None)["hot"]["opcodes"]
        assert (ops["and.b32"], ops["or.b32"], ops["shr.u32"]) == (n_and, n_or, n_shr), variant
        assert ops["shl.b32"] - n_shl == 2 and ops["fma.rn.f32"] == 32, variant
        if tool := sc.disassembler():
            got[variant] = sc.measure(build, weights, per_vector, tool)["hot"]
    if got:
        mix = {v: h["mix"] for v, h in got.items()}
        assert mix["current"]["ffma"] == mix["repacked"]["ffma"] == 32
        integer = {v: m["int"] + m["imad"] for v, m in mix.items()}
        assert integer["current"] - integer["repacked"] == 16, integer


@pytest.mark.dsl
def test_decode_probe_f16x2_has_no_widening(monkeypatch):
    """The packed option's probe: per word the same four pair views as `decode_dot` (8 and,
    4 or) but no halves widened to fp32 and 4 fma.rn.f16x2 instead of 8 fma.rn.f32; in SASS
    at least a quarter fewer instructions per vector."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    _, build, weights, per_vector = sc.case("decode:f16x2")
    ops = sc.measure(build, weights, per_vector, tool=None)["hot"]["opcodes"]
    assert (ops["and.b32"], ops["or.b32"], ops["fma.rn.f16x2"]) == (32, 16, 16), ops
    assert "fma.rn.f32" not in ops
    if tool := sc.disassembler():
        r = {v: sc.measure(sc.case(f"decode:{v}")[1], weights, per_vector, tool)
             for v in ("current", "f16x2")}
        assert r["f16x2"]["hot"]["mix"].get("ffma", 0) == 0
        assert r["f16x2"]["per_vector"] <= 0.75 * r["current"]["per_vector"], r
