"""benchmarks/decode_bits.py: the emulated decode of the MoE kernels, the proposed repacked one
and the fp16 pair views of the packed option all equal the torch reference's E2M1 table
exactly; the layouts really differ; fp16 sums cost less than the output's bf16 rounding."""

import numpy as np

from k3compile.math import E2M1_VALUES
from tests.conftest import load_benchmark

db = load_benchmark("decode_bits")


def test_both_decodes_equal_the_reference():
    assert db.check() == {"current": 0.0, "repacked": 0.0, "f16x2": 0.0}


def test_one_word_in_input_order():
    words = np.array([0x76543210, 0xFEDCBA98], np.uint32)  # inputs 0..15 hold nibbles 0..15
    want = np.array(E2M1_VALUES) * 2.0 ** -126
    for got in (db.decode_current(words), db.decode_repacked(db.repack(words)),
                db.decode_f16x2(words)):
        assert np.array_equal(got.astype(np.float64), want)
        assert np.array_equal(np.signbit(got), np.signbit(want))  # -0.0 at nibble 8


def test_layouts_differ():
    words = db.words_of(np.arange(256, dtype=np.uint8).reshape(2, 128))
    assert not np.array_equal(db.repack(words), words)
    assert not np.array_equal(db.decode_repacked(words), db.decode_current(words))
    assert not np.array_equal(db.decode_current(db.repack(words)), db.decode_current(words))


def test_f16_sums_cost_less_than_the_bf16_output():
    """Two fp16 lanes per 32-input group (z staged so that max |z| is in [2^14, 2^15)): the
    error is a fraction of the bf16 rounding that the reference applies anyway, and not zero
    (the emulation rounds)."""
    err = db.f16_error(rows=64)
    assert 0 < err["f16x2"] < err["bf16_output"] / 2, err
