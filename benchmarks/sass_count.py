"""Offline instruction counts of a kernel build (issue 21): no GPU, on CUTE_DSL_ARCH=sm_90a.

    python benchmarks/sass_count.py                      # FC1, FC2 at 8 and 64 rows; gemv 896x7168
    python benchmarks/sass_count.py --cases fc1:64 --keep DIR   # also writes DIR/fc1_64.sass
    python benchmarks/sass_count.py --json r.json [--ptx]       # --ptx: count PTX, not SASS
    python benchmarks/sass_count.py --text k.sass --weights 448 [--per-vector 32]  # a saved one
    python benchmarks/sass_count.py --cases decode:current,decode:repacked,decode:f16x2  # decode_bits.py
    K3_MOE_F16=1 python benchmarks/sass_count.py --cases fc1:1,fc1:8,fc2:8   # fp16 decode

Builds each case's kernel (kernels/*.py `build` with a dump_dir), disassembles the cubin with
nvdisasm or cuobjdump (pip: nvidia-cuda-nvdisasm, nvidia-cuda-cuobjdump; found on PATH or in
the installed `nvidia` packages; `--disassembler PATH`), or counts the PTX where there is none.

Every loop of these kernels is unrolled at compile time, so a thread runs the static code once
(less what its predicates skip). The *hot phase*: of the stretches between block-wide
boundaries (BAR, EXIT), the one with the most FFMAs, from its start up to the first branch or
epilogue instruction (MUFU, CALL, a store, a conversion) after its first FFMA: for FC1 and FC2
the staged-input loads and the decode + FMA (FC1's also holds the warp sums of the rows
finished first), for gemv the loads and the FMAs. Its count divided by the weights a thread
multiplies is instructions per weight; per vector is per 16-byte weight vector (32 MXFP4
weights or 8 bf16), the source loop's iteration (one `decode_dot`
per call). Real loops (backward branches), where there are any, are listed with their bodies:
per weight then needs their trip counts. Registers and stack frame come from the cubin.
"""

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

L_TP16, I_TP16, K_TP16 = 3584, 192, 16  # one K3 rank at TP16
GROUPS = ("int", "imad", "ffma", "fp", "ldg", "lds", "ld_other", "st", "cvt", "control", "other")
SASS_GROUPS = {
    "ffma": {"FFMA"},
    "imad": {"IMAD"},  # on sm_90 IMAD issues on the FMA pipe (ptxas moves and shifts with it)
    "int": {"LOP3", "LOP", "SHF", "SHL", "SHR", "IADD3", "IADD", "LEA", "PRMT", "SEL", "ISETP",
            "VIADD", "VIMNMX", "IMNMX", "BFE", "BFI", "FLO", "POPC", "IABS", "MOV", "P2R", "R2P",
            "PLOP3", "IMUL", "ISCADD", "BMSK", "BREV", "VIADDMNMX", "S2R", "CS2R", "S2UR"},
    "fp": {"FADD", "FMUL", "FMNMX", "FSETP", "FSEL", "MUFU", "FCHK", "HFMA2", "HADD2", "HMUL2",
           "FSET", "HMNMX2", "DADD", "DMUL", "DFMA"},
    "ldg": {"LDG"},
    "lds": {"LDS", "LDSM"},
    "ld_other": {"LDC", "LDL", "LD", "ULDC", "LDGSTS"},
    "st": {"STG", "STS", "STL", "ST", "RED", "ATOM", "ATOMS", "ATOMG"},
    "cvt": {"F2F", "F2I", "I2F", "F2FP", "I2FP", "FRND", "F2IP"},
    "control": {"BRA", "EXIT", "BSSY", "BSYNC", "BAR", "CALL", "RET", "NOP", "WARPSYNC",
                "DEPBAR", "PREEXIT", "ACQBULK", "BPT", "YIELD", "MEMBAR", "ERRBAR", "CCTL"},
}
# the hot phase: between block-wide boundaries, from its first FFMA up to the first branch or
# epilogue instruction (transcendental, call, store, conversion)
PACKED_FMA = {"HFMA2", "fma.rn.f16x2"}  # packed math counts as the FMAs of a hot phase too
SASS_BOUNDARY, PTX_BOUNDARY = {"BAR", "EXIT", "RET"}, {"bar", "barrier", "ret", "exit"}
SASS_END = {"BRA", "MUFU", "CALL", "STG", "STS", "F2F", "F2FP", "BSYNC"}
PTX_END = {"bra", "ex2", "rcp", "tanh", "call", "st", "cvt.rn.bf16.f32", "cvt.rn.f16.f32"}


@dataclass
class Instr:
    op: str  # the opcode with its modifiers (IMAD.SHL.U32, ld.shared.v4.b32)
    addr: int | None = None  # SASS byte address
    target: str | None = None  # a branch's label or address
    labels: list = field(default_factory=list)  # labels that name this instruction

    @property
    def base(self) -> str:
        return self.op.split(".")[0]


def disassembler(explicit: str | None = None) -> str | None:
    """nvdisasm or cuobjdump: `explicit`, else on PATH, else in the pip `nvidia` packages."""
    if explicit:
        return explicit
    for name in ("nvdisasm", "cuobjdump"):
        if path := shutil.which(name):
            return path
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for name in ("nvdisasm", "cuobjdump"):
            for path in sorted(Path(root).glob(f"*/bin/{name}")):
                if os.access(path, os.X_OK):
                    return str(path)
    return None


def disassemble(cubin: bytes, tool: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        args = [tool, "-c", f.name] if "nvdisasm" in Path(tool).name else [tool, "-sass", f.name]
        return subprocess.run(args, capture_output=True, text=True, check=True).stdout


_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_SASS_TARGET = re.compile(r"`?\(?(\.L_x_\d+|0x[0-9a-f]+)\)?")
_PTX = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][a-z0-9_.]*)\b([^;]*);")
_LABEL = re.compile(r"^\s*([.$\w]+):\s*$")


def parse_sass(text: str) -> list[Instr]:
    """nvdisasm -c or cuobjdump -sass text -> the instructions in address order."""
    out, pending = [], []
    for line in text.splitlines():
        if m := _LABEL.match(line):
            pending.append(m.group(1))
        elif m := _SASS.search(line):
            ins = Instr(m.group(2), int(m.group(1), 16), labels=pending)
            if ins.base in ("BRA", "BSSY", "CALL") and (t := _SASS_TARGET.search(m.group(3))):
                ins.target = t.group(1)
            out.append(ins)
            pending = []
    return out


def parse_ptx(text: str) -> list[Instr]:
    """PTX -> its instructions (directives, declarations and braces skipped)."""
    out, pending = [], []
    for line in text.splitlines():
        line = line.split("//")[0]
        if m := _LABEL.match(line):
            pending.append(m.group(1))
        elif (m := _PTX.match(line)) and not line.lstrip().startswith("."):
            ins = Instr(m.group(1), labels=pending)
            if ins.base == "bra":
                ins.target = m.group(2).strip().split()[-1] if m.group(2).strip() else None
            out.append(ins)
            pending = []
    return out


def group_sass(op: str) -> str:
    base = op.split(".")[0]
    if grp := next((g for g, ops in SASS_GROUPS.items() if base in ops), None):
        return grp
    return "int" if base.startswith("U") else "other"  # the uniform datapath: addresses


def group_ptx(op: str) -> str:
    parts = op.split(".")
    base, types = parts[0], parts[1:]
    floaty = any(t in ("f32", "f16", "bf16", "f16x2", "bf16x2", "f64") for t in types)
    if base == "fma" and "f32" in types:
        return "ffma"
    if base == "cvt":
        return "cvt"
    if base in ("ld", "ldu"):
        return "lds" if "shared" in types else "ldg" if "global" in types else "ld_other"
    if base in ("st", "red", "atom", "cp"):
        return "st"
    if base in ("bra", "bar", "barrier", "ret", "exit", "call", "membar", "fence"):
        return "control"
    if floaty or base in ("ex2", "rcp", "sqrt", "rsqrt", "tanh", "lg2", "sin", "cos"):
        return "fp"
    if base in ("and", "or", "xor", "not", "shl", "shr", "lop3", "add", "sub", "mul", "mad",
                "selp", "setp", "min", "max", "prmt", "bfe", "bfi", "mov", "neg", "abs", "shf",
                "mul24", "mad24", "popc", "clz", "brev", "cnot"):
        return "int"
    return "other"


def hot_phase(instrs: list[Instr], ptx: bool) -> tuple[int, int]:
    """[start, end) of the hot phase: of the stretches between block-wide boundaries, the one
    with the most FFMAs, cut at the first `*_END` instruction after its first FFMA."""
    group = group_ptx if ptx else group_sass
    boundary, end_ops = (PTX_BOUNDARY, PTX_END) if ptx else (SASS_BOUNDARY, SASS_END)
    cuts = [-1] + [i for i, ins in enumerate(instrs) if ins.base in boundary] + [len(instrs)]
    fma = lambda ins: group(ins.op) == "ffma" or ins.base in PACKED_FMA
    start, stop = max(zip([c + 1 for c in cuts], cuts[1:]), key=lambda r: sum(
        fma(ins) for ins in instrs[r[0]:r[1]]))
    first = next((i for i in range(start, stop) if fma(instrs[i])), stop)
    end = next((i for i in range(first, stop)
                if instrs[i].base in end_ops or instrs[i].op in end_ops), stop)
    return start, end


def loops(instrs: list[Instr]) -> list[tuple[int, int]]:
    """[start, end] index ranges of backward branches' bodies (target at or before the branch)."""
    where = {}
    for i, ins in enumerate(instrs):
        for label in ins.labels:
            where[label] = i
        if ins.addr is not None:
            where[f"0x{ins.addr:x}"] = i
    return [(where[ins.target], i) for i, ins in enumerate(instrs)
            if ins.base.lower() == "bra" and ins.target in where and where[ins.target] < i]
    # (a branch to itself is the trap after EXIT)


def mix(instrs: list[Instr], ptx: bool) -> Counter:
    group = group_ptx if ptx else group_sass
    return Counter(group(ins.op) for ins in instrs)


def count(text: str, ptx: bool, weights: int, per_vector: int) -> dict:
    """The counts of one kernel's disassembly (or PTX): `weights` per thread, `per_vector` weights
    per 16-byte vector."""
    instrs = parse_ptx(text) if ptx else parse_sass(text)
    start, end = hot_phase(instrs, ptx)
    hot = instrs[start:end]
    hot_mix = mix(hot, ptx)
    vectors = weights / per_vector
    return {
        "isa": "ptx" if ptx else "sass",
        "instructions": len(instrs),
        "static_mix": dict(mix(instrs, ptx)),
        "hot": {"first": start, "count": len(hot), "mix": dict(hot_mix),
                "opcodes": dict(Counter(i.op for i in hot).most_common())},
        "weights_per_thread": weights,
        "per_vector": round(len(hot) / vectors, 2),
        "per_weight": round(len(hot) / weights, 3),
        "per_weight_mix": {g: round(hot_mix[g] / weights, 3) for g in GROUPS if hot_mix[g]},
        "loops": [{"first": a, "last": b, "count": b - a + 1,
                   "mix": dict(mix(instrs[a:b + 1], ptx))} for a, b in loops(instrs)],
        "spill_ops": 0 if ptx else sum(i.base in ("STL", "LDL") for i in instrs),
    }


# ---- the cases: (build, weights multiplied per thread, weights per 16-byte vector) ----


def moe_case(stage: str, rows: int, latent=L_TP16, inter=I_TP16, top_k=K_TP16):
    from k3compile.kernels import moe_experts as m

    cfg = m.config(stage, latent, inter, top_k, rows)
    if stage == "fc1":
        steps, split = m._lane_steps(latent)
        weights = 32 * cfg.rows_per_warp * (2 * steps + split)  # W1 and W3; split: one of them
    else:
        weights = inter  # thread (l, j): one W2 row
    build = lambda dump: m.build(stage, latent, inter, top_k, True, cfg, dump_dir=dump,
                                 arch=os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    return (stage, latent, inter, top_k, cfg), build, weights, 32


def gemv_case(n: int, k: int, m_rows: int, *knobs: int):
    """`knobs`: R, T[, C] of a gemv Config (default: `gemv.config`). Weights: one row block's
    (a persistent grid's loop body holds two)."""
    from k3compile.kernels.common import gemv

    cfg = gemv.Config(*knobs) if knobs else gemv.config(n, k, m_rows)
    weights = 8 * cfg.rows_per_cta * gemv._vec_per_thread(k, cfg.threads)  # static slots
    build = lambda dump: gemv.build(n, k, m_rows, False, False, cfg, dump_dir=dump,
                                    arch=os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    return ("gemv", n, k, m_rows, cfg), build, weights, 8


def decode_case(variant: str):
    """benchmarks/decode_bits.py's probe: one 16-byte vector per thread by `decode_dot`
    ('current'), the repacked decode ('repacked') or packed fp16 math ('f16x2'); the loads
    from global memory count."""
    spec = importlib.util.spec_from_file_location("decode_bits", Path(__file__).with_name(
        "decode_bits.py"))
    bits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bits)
    kinds = {"current": False, "repacked": True, "f16x2": "f16x2"}
    if variant not in kinds:
        raise SystemExit(f"decode:{variant}? (decode:current, decode:repacked, decode:f16x2)")
    build = lambda dump: bits.build_probe(kinds[variant], dump_dir=dump,
                                          arch=os.environ.get("CUTE_DSL_ARCH", "sm_90a"))
    return ("decode", variant), build, 32, 32


def case(spec: str):
    """'fc1:64', 'fc2:8' (TP16 shapes), 'fc1:64:3584:192:16', 'gemv:896:7168:1',
    'gemv:896:7168:1:2:256:2' (R, T, C), 'decode:current', 'decode:repacked'."""
    name, *nums = spec.split(":")
    if name == "decode":
        return decode_case(*nums)
    nums = [int(x) for x in nums]
    if name in ("fc1", "fc2"):
        return moe_case(name, *nums)
    if name == "gemv":
        return gemv_case(*nums)
    raise SystemExit(f"unknown case {spec!r} (fc1:ROWS, fc2:ROWS, gemv:N:K:M[:R:T[:C]])")


def measure(build, weights: int, per_vector: int, tool: str | None, ptx: bool = False,
            keep: Path | None = None, name: str = "kernel") -> dict:
    from k3compile.kernels.common.dsl import cubin_of, cubin_resources, ptx_of

    with tempfile.TemporaryDirectory() as dump:  # the DSL writes nothing to a missing dir
        compiled = build(dump)
        cubin, ptx_text = cubin_of(compiled), ptx_of(compiled)
    use_ptx = ptx or tool is None
    text = ptx_text if use_ptx else disassemble(cubin, tool)
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"{name}.{'ptx' if use_ptx else 'sass'}").write_text(text)
    out = count(text, use_ptx, weights, per_vector)
    out.update(cubin_resources(cubin))
    return out


def show(name: str, cfg, r: dict) -> None:
    hot = r["hot"]
    print(f"{name}: {cfg}")
    print(f"  {r['regs']} registers, stack frame {r['frame']} B, {r['spill_ops']} LDL/STL;"
          f" {r['instructions']} {r['isa'].upper()} instructions, hot phase {hot['count']}"
          f" from #{hot['first']}")
    print(f"  per thread {r['weights_per_thread']} weights: {r['per_vector']} per 16-byte vector,"
          f" {r['per_weight']} per weight")
    print("  per weight: " + ", ".join(f"{g} {v}" for g, v in r["per_weight_mix"].items()))
    print("  hot opcodes: " + ", ".join(f"{op} {n}" for op, n in list(hot["opcodes"].items())[:12]))
    for lp in r["loops"]:
        print(f"  loop #{lp['first']}-#{lp['last']}: {lp['count']} instructions {lp['mix']}")


DEFAULT = ("fc1:8", "fc1:64", "fc2:8", "fc2:64", "gemv:896:7168:1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(DEFAULT))
    p.add_argument("--disassembler", help="nvdisasm or cuobjdump (default: found)")
    p.add_argument("--ptx", action="store_true", help="count the PTX even with a disassembler")
    p.add_argument("--keep", type=Path, help="write each disassembly there")
    p.add_argument("--json", type=Path)
    p.add_argument("--text", type=Path, help="count this saved SASS (or .ptx) file instead")
    p.add_argument("--weights", type=int, help="with --text: weights per thread")
    p.add_argument("--per-vector", type=int, default=32, help="with --text: weights per vector")
    a = p.parse_args()
    if a.text:
        r = count(a.text.read_text(), a.text.suffix == ".ptx", a.weights, a.per_vector)
        show(str(a.text), "", {"regs": "?", "frame": "?", **r})
        return
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    tool = disassembler(a.disassembler)
    if tool is None and not a.ptx:
        print("no nvdisasm / cuobjdump (pip install nvidia-cuda-nvdisasm): counting PTX",
              file=sys.stderr)
    results, seen = {}, {}
    for spec in a.cases.split(","):
        key, build, weights, per_vector = case(spec)
        if key in seen:  # the same build (configs that do not depend on the rows)
            print(f"{spec}: the build of {seen[key]}\n")
            results[spec] = {"same_as": seen[key]}
            continue
        seen[key] = spec
        r = measure(build, weights, per_vector, tool, a.ptx, a.keep, spec.replace(":", "_"))
        r["config"] = str(key)
        show(spec, key, r)
        print()
        results[spec] = r
    if a.json:
        a.json.write_text(json.dumps({"disassembler": tool and Path(tool).name,
                                      "cases": results}, indent=1))


if __name__ == "__main__":
    main()
