"""Warp-level tensor-core pieces by inline PTX (device code; import only where `cutlass` is
present): mma.sync m16n8k16 with bf16 inputs and fp32 sums, ldmatrix from shared memory, and
bf16 packing. Fragments are lists of 32-bit registers in the PTX ISA's order: for a lane with
g = lane >> 2, t = lane & 3, A (16 x 16) holds (g, 2t..2t+1), (g + 8, 2t..), (g, 2t + 8..),
(g + 8, 2t + 8..); B (16 x 8, k x n) holds (2t..2t+1, g), (2t + 8.., g); C (16 x 8) holds
(g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1). The lower k (or column) of a packed pair is
its low half."""

from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def mma_16816(a, b, c, *, loc=None, ip=None):
    """D = A·B + C, m16n8k16, bf16 inputs, fp32 sums: a 4 and b 2 packed bf16x2 registers,
    c 4 fp32 values, in the PTX fragment order."""
    regs = [Uint32(x).ir_value(loc=loc, ip=ip) for x in (*a, *b)]
    regs += [Float32(x).ir_value(loc=loc, ip=ip) for x in c]
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4), regs,
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def ldmatrix_x4(addr, trans: bool = False, *, loc=None, ip=None):
    """Four 8 x 8 bf16 matrices from shared memory (`addr`: this lane's 32-bit shared address
    of row lane % 8 of matrix lane // 8, 16 bytes): register i holds matrix i's (g, 2t..2t+1),
    or with `trans` its (2t..2t+1, g) (one column pair of two rows)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.i32()] * 4), [Int32(addr).ir_value(loc=loc, ip=ip)],
        f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if trans else ''}.shared.b16 "
        "{$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [Uint32(llvm.extractvalue(T.i32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


@dsl_user_op
def pack_bf16x2(lo, hi, *, loc=None, ip=None) -> Uint32:
    """Two fp32 values rounded to bf16 (to nearest even) in one register, `lo` in the low half."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))
