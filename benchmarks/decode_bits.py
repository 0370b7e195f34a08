"""A numpy emulation of the MXFP4 decode of the per-pair MoE kernels (`decode_dot`,
kernels/device/moe_experts.py) and of a proposed cheaper one, both against the torch reference
(k3compile.math `mxfp4_dequant`, the E2M1 table). Nothing here runs in a kernel.

    python benchmarks/decode_bits.py      # checks both on every byte value and random experts

Both decode a 32-bit word of 8 nibbles (inputs 8w .. 8w + 7) as four *pair views*: a word
whose 16-bit halves are the bf16-like patterns (sign at bit 15, e1 e0 m at bits 8..6) of inputs
i and i + 4; the low half << 16 and the high half & 0xFFFF0000 are then fp32 weights times
2^-126 (E2M1 0.5 lands on a subnormal, exactly).

* `decode_current`: the kernels' layout (nibble j of the word is input 8w + j). A view takes
  t = q << (12, 8, 4, 0)[i], (t & 0x80008000) | ((t >> 6) & 0x01C001C0). In SASS
  (benchmarks/sass_count.py, FC2 at I = 32): 7 shifts + 8 LOP3 (two immediates cost two
  LOP3) per word for the views, then 4 shifts + 4 LOP3 for the halves: 23 per 8 weights.
* `decode_repacked`: the same views from a word whose bits are permuted once, at weight load
  (`repack`): per half, pair 0's e1 e0 m at bits 8..6 and sign at 15 (view = q & MASK),
  pair 1's at 5..3 and 12 (view = (q << 3) & MASK), pair 2's at 2..0 and 13, pair 3's at
  11..9 and 14 (sign and magnitude from two shifts each). 5 shifts + 6 LOP3 per word for the
  views, the halves as before: 19 per 8 weights (no three contiguous bits are left over for a
  fourth one-mask view: at most three translates of MASK fit in a word, at shifts 0, 3, 6).
* `decode_f16x2` (issue 21's option a, fp16 not bf16; FC1's K3_MOE_F16 build,
  `decode_dot_f16x2` in kernels/device/moe_experts.py): the kernels' layout, views in fp16
  bits, (t & SIGN) | ((t >> 3) & F16_MAG), 2^-14 times E2M1, consumed by fma.rn.f16x2 (no
  halves widened, half the FMAs); `f16_error` measures what the fp16 sums cost.
"""

import numpy as np

SIGN, MAG, MASK = 0x80008000, 0x01C001C0, 0x81C081C0
F16_MAG = 0x0E000E00  # e1 e0 m in fp16 bits (exponent bits 11, 10, mantissa bit 9)
PAIR_SHIFT = (12, 8, 4, 0)
# the repacked layout, per half: (bit of e1 e0 m's lowest bit, bit of the sign) of pair i
REPACKED = ((6, 15), (3, 12), (0, 13), (9, 14))


def words_of(packed: np.ndarray) -> np.ndarray:
    """[..., in/2] uint8 (the low nibble the even input) -> [..., in/8] uint32, as the kernels
    read them (little-endian int32 words)."""
    return np.ascontiguousarray(packed).view("<u4")


def nibbles_of(words: np.ndarray) -> np.ndarray:
    """[..., W] uint32 -> [..., W, 8] nibbles in input order."""
    return (words[..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF


def halves(view: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A pair view -> (input i, input i + 4) as fp32 times 2^-126."""
    lo = (view << np.uint32(16)).view(np.float32)
    hi = (view & np.uint32(0xFFFF0000)).view(np.float32)
    return lo, hi


def _assemble(words: np.ndarray, views) -> np.ndarray:
    out = np.empty(words.shape + (8,), np.float32)
    for i, view in enumerate(views):
        out[..., i], out[..., i + 4] = halves(view)
    return out.reshape(*words.shape[:-1], -1)


def decode_current(words: np.ndarray) -> np.ndarray:
    """`decode_dot`'s weights: [..., W] uint32 -> [..., 8W] fp32 times 2^-126."""
    q = words.astype(np.uint32)
    views = []
    for s in PAIR_SHIFT:
        t = q << np.uint32(s)
        views.append((t & np.uint32(SIGN)) | ((t >> np.uint32(6)) & np.uint32(MAG)))
    return _assemble(q, views)


def repack(words: np.ndarray) -> np.ndarray:
    """The kernels' words -> the permuted layout of `decode_repacked` (once, at load)."""
    nib = nibbles_of(words.astype(np.uint32))
    out = np.zeros(words.shape, np.uint32)
    for i, (mag_at, sign_at) in enumerate(REPACKED):
        for half, j in ((0, i), (1, i + 4)):
            n = nib[..., j]
            out |= ((n & 7) << np.uint32(mag_at + 16 * half)) | (
                (n >> 3) << np.uint32(sign_at + 16 * half))
    return out


def decode_repacked(words: np.ndarray) -> np.ndarray:
    """The proposed decode of `repack`ed words: 5 shifts + 6 LOP3 for the four views."""
    q = words.astype(np.uint32)
    u = np.uint32
    views = [
        q & u(MASK),  # 1 LOP3
        (q << u(3)) & u(MASK),  # 1 shift, 1 LOP3
        ((q << u(2)) & u(SIGN)) | ((q << u(6)) & u(MAG)),  # 2 shifts, 2 LOP3
        ((q << u(1)) & u(SIGN)) | ((q >> u(3)) & u(MAG)),  # 2 shifts, 2 LOP3
    ]
    return _assemble(q, views)


def decode_f16x2(words: np.ndarray) -> np.ndarray:
    """The packed option (`decode_dot_f16x2`): native words, views in fp16 bits,
    (t & SIGN) | ((t >> 3) & F16_MAG): [..., W] uint32 -> [..., 8W] fp32 times 2^-126 (the
    fp16 values, exactly 2^-14 times E2M1, rescaled to compare with the other decodes)."""
    q = words.astype(np.uint32)
    out = np.empty(q.shape + (8,), np.float32)
    for i, s in enumerate(PAIR_SHIFT):
        t = q << np.uint32(s)
        view = (t & np.uint32(SIGN)) | ((t >> np.uint32(3)) & np.uint32(F16_MAG))
        for half, j in ((0, i), (1, i + 4)):
            h = ((view >> np.uint32(16 * half)) & np.uint32(0xFFFF)).astype(np.uint16)
            out[..., j] = h.view(np.float16).astype(np.float32) * np.float32(2.0 ** -112)
    return out.reshape(*q.shape[:-1], -1)


def f16_error(rows: int = 256, depth: int = 3584, seed: int = 0) -> dict:
    """What fp16 sums cost (option a, `decode_dot_f16x2`): rows of random E2M1 weights (one
    scale) dotted with one bf16 z of heavy-tailed magnitudes, staged times 2^c so that max |z|
    lands in [2^14, 2^15) (fp16 products of a bf16 z and an E2M1 weight are then exact), each
    32-input group summed by two fp16 lanes of 16 fused multiply-adds (one rounding each),
    widened, the groups summed in fp64. ‖err‖ / ‖exact‖ of that ('f16x2') and of the bf16
    rounding that the reference applies to the same exact sums ('bf16_output')."""
    rng = np.random.default_rng(seed)
    table = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    w = table[rng.integers(0, 16, (rows, depth))]
    z = rng.standard_normal(depth) * np.exp(rng.standard_normal(depth))
    z = (z.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    exact = w @ z.astype(np.float64)
    c = 14 - np.floor(np.log2(np.abs(z).max()))
    prod = (w * 2.0 ** -14) * (z * 2.0 ** c)  # exact in fp64 (and in fp16)
    lanes = prod.reshape(rows, depth // 32, 4, 2, 4).transpose(0, 1, 3, 2, 4).reshape(
        rows, depth // 32, 2, 16)  # lane 0: inputs i of each word's pairs, lane 1: i + 4
    acc = np.zeros(lanes.shape[:-1], np.float16)
    for k in range(16):
        acc = (acc.astype(np.float64) + lanes[..., k]).astype(np.float16)
    got = acc.astype(np.float64).sum((-1, -2)) * 2.0 ** (14 - c)
    bf16 = (exact.astype(np.float32).view(np.uint32) + np.uint32(0x8000)) & np.uint32(
        0xFFFF0000)  # round half up: enough for a norm
    rel = lambda a: float(np.linalg.norm(a - exact) / np.linalg.norm(exact))
    return {"f16x2": rel(got), "bf16_output": rel(bf16.view(np.float32).astype(np.float64))}


def dequant(decoded: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """fp32 weights times 2^-126 and E8M0 scales [..., in/32] -> the weights, as fp64."""
    factor = np.exp2(scale.astype(np.float64) - 127.0 + 126.0)
    return (decoded.astype(np.float64).reshape(*scale.shape, 32) * factor[..., None]).reshape(
        decoded.shape)


def check(seed: int = 0) -> dict:
    """Both decodes against `mxfp4_dequant` on every byte value and on random experts: the
    largest absolute difference of each (0.0 is exact)."""
    import torch

    from k3compile.math import e2m1_table, mxfp4_dequant

    rng = np.random.default_rng(seed)
    every = np.tile(np.arange(256, dtype=np.uint8), 8).reshape(4, 512)  # 4 rows of 1024 inputs
    packed = np.concatenate([every, rng.integers(0, 256, (60, 512), dtype=np.uint8)])
    scale = rng.integers(0, 225, (64, 32), dtype=np.uint8)  # the kernels take bytes <= 224
    ref = mxfp4_dequant(torch.from_numpy(packed), torch.from_numpy(scale),
                        e2m1_table(dtype=torch.float32)).double().numpy()
    words = words_of(packed)
    out = {}
    for name, got in (("current", decode_current(words)),
                      ("repacked", decode_repacked(repack(words))),
                      ("f16x2", decode_f16x2(words))):
        out[name] = float(np.abs(dequant(got, scale) - ref).max())
    return out


if __name__ == "__main__":
    print(check())
    print(f16_error())


# ---- a probe kernel for benchmarks/sass_count.py: one 16-byte vector per thread, decoded by
# `decode_dot` or the repacked decode (a benchmark's kernel, not a k3 kernel) ----


def decode_dot_repacked(words, z):
    """`decode_dot` on `repack`ed words: the same sum, in the same order."""
    from cutlass import Float32, Uint32

    p = Float32(0.0)
    for w in range(4):
        q = words[w]
        views = (q & Uint32(MASK), (q << 3) & Uint32(MASK),
                 ((q << 2) & Uint32(SIGN)) | ((q << 6) & Uint32(MAG)),
                 ((q << 1) & Uint32(SIGN)) | ((q >> 3) & Uint32(MAG)))
        for i, bits in enumerate(views):
            p = p + (bits << 16).bitcast(Float32) * z[8 * w + i]
            p = p + (bits & Uint32(0xFFFF0000)).bitcast(Float32) * z[8 * w + i + 4]
    return p


def build_probe(repacked, arch: str = "sm_90a", dump_dir: str | None = None):
    """Compile the probe: thread t reads words row t (4 int32) and z row t (32 fp32, or for
    'f16x2' 16 fp16x2 words) from global memory and writes the dot to y[t]. `repacked`:
    False (`decode_dot`), True (`decode_dot_repacked`) or 'f16x2' (`decode_dot_f16x2`)."""
    import cutlass
    from cutlass import Float32, Int32, Uint32, cute
    from cutlass.cute.runtime import make_fake_tensor
    from k3compile.kernels.common.copy import make_frag, row_vectors
    from k3compile.kernels.common.dsl import compile_kernel, fake_stream
    from k3compile.kernels.device.moe_experts import decode_dot, decode_dot_f16x2

    f16 = repacked == "f16x2"
    dot = decode_dot_f16x2 if f16 else decode_dot_repacked if repacked else decode_dot

    class DecodeProbe:
        @cute.jit
        def __call__(self, mW: cute.Tensor, mZ: cute.Tensor, mY: cute.Tensor, stream):
            self.kernel(mW, mZ, mY).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, mW: cute.Tensor, mZ: cute.Tensor, mY: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            rW = make_frag(Int32, 1)  # (4, 1)
            cute.autovec_copy(row_vectors(mW, tidx)[None, 0], rW[None, 0])
            zn = 16 if f16 else 32
            rZ = cute.make_rmem_tensor(cute.make_layout((zn,)), Uint32 if f16 else Float32)
            rZ4 = cute.zipped_divide(rZ, (4,))  # (4, zn/4)
            gZ = row_vectors(mZ, tidx)  # (4, zn/4)
            for q in cutlass.range_constexpr(zn // 4):
                cute.autovec_copy(gZ[None, q], rZ4[None, q])
            mY[tidx] = dot(rW[None, 0].load().bitcast(Uint32), rZ.load())

    n = cute.sym_int()
    return compile_kernel(
        DecodeProbe(), make_fake_tensor(Int32, (n, 4), stride=(4, 1), assumed_align=16),
        make_fake_tensor(Uint32, (n, 16), stride=(16, 1), assumed_align=16) if f16 else
        make_fake_tensor(Float32, (n, 32), stride=(32, 1), assumed_align=16),
        make_fake_tensor(Float32, (n,), stride=(1,), assumed_align=4), fake_stream(),
        arch=arch, dump_dir=dump_dir)
