"""benchmarks/sanitize.py on CPU: `--list` plans every kernel module at every bucket (and T = 8
where the op takes verify rows), a case's checking code passes the op's CPU implementation and
catches wrong values (a row, a state slot, an id), and the summary attributes sanitizer reports
to the case that was running."""

from __future__ import annotations

import json
import pkgutil

import k3compile.kernels
import pytest
import torch

from tests.conftest import load_benchmark

san = load_benchmark("sanitize")


def test_list_plans_every_kernel_at_every_bucket(capsys):
    assert san.main(["--list"]) == 0
    listed = capsys.readouterr().out
    modules = {m.name for m in pkgutil.iter_modules(k3compile.kernels.__path__) if not m.ispkg}
    assert set(k3compile.kernels.KERNELS) <= modules and "mla_decode" in modules
    assert "kernels without a case" not in listed
    for kernel in modules:
        rows = (1,) if kernel in san.ONE_ROW else (1, 8, 64)
        for b in rows:
            assert f"{kernel}/B{b} " in listed, (kernel, b)
    for kernel in ("kda_decode", "fb_kda_decode", "mla_decode"):
        assert f"{kernel}/B8T8 " in listed
    dealt = set()
    for i in range(3):
        capsys.readouterr()
        san.main(["--list", "--shard", f"{i}/3"])
        names = {line.split()[0] for line in capsys.readouterr().out.splitlines()
                 if "/B" in line.split()[0]}
        assert not names & dealt
        dealt |= names
    assert dealt == {c.name for c in san.plan()}, "the shards together are the whole plan"


def _call(kernel, B=2, T=1):
    return san.BUILDERS[kernel][0](torch.Generator().manual_seed(0), "cpu", B, T)


def test_a_case_runs_on_cpu_and_agrees_with_its_reference():
    for kernel, B, T in (("rms_norm", 8, 1), ("kda_decode", 2, 8), ("moe_route", 8, 1)):
        result = san.run_case(san.Case(kernel, B, T, ""), device="cpu")
        assert result["status"] == "ok", result


def test_rows_close_catches_one_wrong_row():
    call = _call("attn_res_mix_norm")
    prefix_out, x = call.reference(*call.args)
    assert san.rows_close([prefix_out, x], [prefix_out.clone(), x.clone()]) == []
    wrong = x.clone()
    wrong[1] *= 1.1  # one request 10% off: its row's error, not diluted by the others
    assert "output 1: row 1 off by 0.1" in " ".join(san.rows_close([prefix_out, wrong],
                                                                     [prefix_out, x]))
    nan = x.clone()
    nan[0, 3] = float("nan")
    assert "non-finite" in san.rows_close([nan], [x])[0]
    assert "reference" in san.rows_close([x[:1]], [x])[0]  # shape
    assert "reference" in san.rows_close([x.float()], [x])[0]  # dtype


def test_a_written_state_slot_is_compared():
    """kda_decode writes its states in place: a kernel that wrote a wrong slot fails."""
    call = _call("kda_decode")
    args = san._states(call)
    want = san._flat(call.reference(*args), args, call)
    args = san._states(call)
    got = san._flat(call.reference(*args), args, call)
    assert san.rows_close(got, want) == []
    got[2][call.args[8][0]] += 0.01  # the first request's recurrent-state slot
    problems = san.rows_close(got, want)
    assert len(problems) == 1 and problems[0].startswith("output 2: row")


def test_route_compare_catches_a_wrong_expert():
    call = _call("moe_route", B=4)
    ids, w = call.reference(*call.args)
    assert call.compare([ids, w], [ids, w]) == []
    shuffled = ids.flip(-1), w.flip(-1)  # another order of the same choice is the same choice
    assert call.compare(list(shuffled), [ids, w]) == []
    wrong = ids.clone()
    wrong[2, 0] = next(e for e in range(san.EXPERTS) if e not in ids[2])
    assert "elements differ" in " ".join(call.compare([wrong, w], [ids, w]))
    wrong[2, 0] = ids[2, 1]
    assert call.compare([wrong, w], [ids, w]) == ["an expert chosen twice"]


LOG = """registered: ['rms_norm']
========= COMPUTE-SANITIZER
========= Program hit cudaErrorPeerAccessUnsupported (error 217) due to "peer access is not supported" on CUDA API call to cudaDeviceCanAccessPeer.
=========     Saved host backtrace up to driver entry point at error
SAN-CASE begin rms_norm/B1
SAN-CASE end rms_norm/B1 ok 1.2 s
SAN-CASE begin kda_decode/B8
========= Invalid __global__ read of size 16 bytes
=========     at kernel_cutlass_kda_decode_0+0x1a40 in /tmp/kda.py:120
=========     by thread (3,0,0) in block (1,0,0)
=========     Address 0x7f0000000000 is out of bounds
=========
========= Error: Race reported between Write access at kernel_cutlass_kda_decode_0+0x200
=========     and Read access at kernel_cutlass_kda_decode_0+0x300 [64 hazards]
SAN-CASE end kda_decode/B8 fail 3.0 s output 0: row 2 off by 0.5
========= ERROR SUMMARY: 3 errors
"""


def test_parse_log_attributes_reports_to_the_running_case():
    parsed = san.parse_log(LOG)
    found = parsed["cases"]["kda_decode/B8"]
    assert [r["message"][:12] for r in found] == ["Invalid __gl", "Error: Race "]
    assert found[0]["where"].startswith("at kernel_cutlass_kda_decode_0+0x1a40")
    assert "rms_norm/B1" not in parsed["cases"] and parsed["outside"] == []
    assert len(parsed["api"]) == 1 and parsed["api"][0]["case"] is None
    assert parsed["summary"] == ["ERROR SUMMARY: 3 errors"]


def test_summary_counts_per_kernel(tmp_path):
    results = [{"case": "rms_norm/B1", "kernel": "rms_norm", "B": 1, "T": 1, "status": "ok",
                "problems": [], "fallbacks": {}},
               {"case": "kda_decode/B8", "kernel": "kda_decode", "B": 8, "T": 1,
                "status": "fail", "problems": ["output 0: row 2 off by 0.5"], "fallbacks": {}}]
    (tmp_path / "memcheck_0.json").write_text(json.dumps(results))
    (tmp_path / "memcheck_0.log").write_text(LOG)
    (tmp_path / "canary_0.log").write_text(
        "SAN-CASE begin canary/kda_decode\n========= Invalid __global__ write of size 4 bytes\n")
    (tmp_path / "preflight.log").write_text("========= Invalid __global__ read\n")  # not a tool's
    text = san.summarize(tmp_path)
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.startswith(("rms_norm ", "kda_decode "))}
    assert rows == {"rms_norm": ["1", "1", "0", "0"], "kda_decode": ["1", "0", "1", "2"]}
    assert "kda_decode/B8: fail: output 0: row 2 off by 0.5" in text
    assert "CUDA API errors reported: 1" in text
    assert "canary (kda_decode, slot out of range): 1 reports -- the sanitizer sees" in text
    assert "preflight" not in text
    assert (tmp_path / "summary.txt").read_text().strip() == text
    assert set(json.loads((tmp_path / "summary.json").read_text())["reports"]) == {
        "memcheck", "canary"}


@pytest.mark.parametrize("kernel", ["mla_decode", "fb_kda_decode"])
def test_states_written_in_place_are_the_right_arguments(kernel):
    """`mutates` names the op's in-place arguments the call passes (its schema's mutable ones
    given a tensor; fb_kda_decode's k / v conv states are None in the one-buffer call)."""
    call = _call(kernel, B=1)
    schema = getattr(torch.ops.k3, call.op).default._schema
    written = tuple(i for i, (a, v) in enumerate(zip(schema.arguments, call.args))
                    if a.alias_info is not None and a.alias_info.is_write and v is not None)
    assert call.mutates == written
