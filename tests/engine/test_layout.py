"""The layout's rules, read from the source: imports run downwards only, every `K3_*` switch is read
in `k3compile/settings.py`, and one name finds every piece of a fusion."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

from k3compile import settings
from k3compile.canonical import ORDER

ROOT = Path(__file__).resolve().parents[2]

# ops that no pattern produces: the stages insert them (their tests live with the stage)
STAGE_OPS = {"stream_fork": "streams", "stream_join": "streams", "prefetch_l2": "prefetch"}
# patterns that are variants of another op's fusion (a second search form for the same op)
VARIANT_PATTERNS = {"norm_linear_residual": "norm_linear"}


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included), with
    relative imports resolved against the file's package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _package_of(path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant):
                out.add(str(node.args[0].value))
    return out


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    top = {"kernels": ["k3compile", "kernels"], "patterns": ["k3compile", "patterns"]}
    parts = top.get(parts[0], [parts[0]]) + parts[1:]
    return ".".join(parts[:-1]) if parts[-1] != "__init__" else ".".join(parts[:-1])


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _offending(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in _files(folder):
        for mod in _imports(path):
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    return sorted(set(bad))


def test_kernels_import_no_patterns_stages_or_pipeline():
    assert _offending("kernels", ("k3compile.patterns", "k3compile.stages", "k3compile.pipeline",
                                  "k3compile.backend", "k3compile.rewrite", "k3compile.tools")) == []


def test_patterns_import_no_kernel_module():
    assert _offending("patterns", ("k3compile.kernels",)) == []


def test_ops_import_no_models_kernels_or_patterns():
    assert _offending("k3compile/ops", ("k3compile.models", "k3compile.kernels",
                                        "k3compile.patterns", "k3compile.stages")) == []


def test_models_import_no_compiler():
    assert _offending("k3compile/models", ("k3compile.ops", "k3compile.kernels",
                                           "k3compile.patterns", "k3compile.stages",
                                           "k3compile.rewrite")) == []


def test_the_check_itself_catches_an_upward_import(tmp_path, monkeypatch):
    """The import scan finds a function-level and a relative import (negative control)."""
    fake = ROOT / "kernels" / "_layout_probe.py"
    src = "def f():\n    from k3compile.patterns import all_patterns\nfrom ..stages import pack\n"
    try:
        fake.write_text(src)
        found = _offending("kernels", ("k3compile.patterns", "k3compile.stages"))
    finally:
        fake.unlink()
    assert any("_layout_probe.py imports k3compile.patterns" in f for f in found)
    assert any("_layout_probe.py imports k3compile.stages" in f for f in found)


def _environ_reads(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in ("environ", "getenv") for a in node.names):
                lines.append(node.lineno)
    return lines


def test_no_environment_read_outside_settings():
    bad = []
    for folder in ("k3compile", "kernels", "patterns"):
        for path in _files(folder):
            if path == ROOT / "k3compile" / "settings.py":
                continue
            bad += [f"{path.relative_to(ROOT)}:{n}" for n in _environ_reads(path)]
    assert bad == [], "read K3_* switches through k3compile.settings"


def _k3_ops() -> set[str]:
    names = set()
    for path in _files("k3compile/ops"):
        names.update(re.findall(r'custom_op\(\s*"k3::(\w+)"', path.read_text()))
    return names


def test_one_name_finds_every_piece_of_a_fusion():
    ops = _k3_ops()
    assert len(ops) >= 17, ops
    missing = []
    for name in sorted(ops):
        if not (ROOT / "k3compile" / "ops" / f"{name}.py").exists():
            missing.append(f"k3compile/ops/{name}.py")
        if name in STAGE_OPS:
            if not (ROOT / "tests" / "stages" / f"test_{STAGE_OPS[name]}.py").exists():
                missing.append(f"tests/stages/test_{STAGE_OPS[name]}.py")
            continue
        if not (ROOT / "patterns" / f"{name}.py").exists():
            missing.append(f"patterns/{name}.py")
        if not (ROOT / "tests" / "fusions" / f"test_{name}.py").exists():
            missing.append(f"tests/fusions/test_{name}.py")
    assert missing == []


def test_every_pattern_file_names_an_op():
    ops = _k3_ops()
    names = [p.stem for p in _files("patterns") if p.stem != "__init__"]
    assert [n for n in names if n not in ops and n not in VARIANT_PATTERNS] == []


def test_no_family_or_composite_files():
    assert not (ROOT / "kernels" / "composite.py").exists()
    for family in ("attn_res", "gemm", "kda", "mla", "moe", "norms"):
        assert not (ROOT / "k3compile" / "ops" / f"{family}.py").exists(), family


def test_readme_switch_table_matches_settings():
    text = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"^\| `(K3_[A-Z0-9_]+)` \|", text, re.M))
    assert listed == set(settings.SWITCHES)


def _readme_rules() -> list[list[str]]:
    """The rules each row of README's canonical-rules table names in its first cell."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| rule | takes | gives |\n|---|---|---|\n"):].splitlines()[2:]
    rows = itertools.takewhile(lambda line: line.startswith("|"), table)
    return [re.findall(r"`(\w+)`", row.split("|")[1]) for row in rows]


def test_readme_rules_table_matches_order():
    """Every canonical rule has a row in README's table, and every name there is a rule."""
    named = [name for row in _readme_rules() for name in row]
    assert all(_readme_rules())  # no row without a rule's name
    assert sorted(named) == sorted(set(named))  # one row a rule
    assert [n for n in ORDER if n not in named] == []
    assert [n for n in named if n not in ORDER] == []


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("ON", True),
                                            ("0", False), ("false", False), ("", False),
                                            (None, None)])
def test_one_rule_for_booleans(value, expected):
    assert settings.parse_bool("K3_PDL", value) is expected


def test_a_bad_boolean_is_an_error_naming_the_switch():
    with pytest.raises(ValueError, match="K3_PDL='maybe'"):
        settings.parse_bool("K3_PDL", "maybe")


def test_kernel_settings_from_environment(monkeypatch):
    monkeypatch.setenv("K3_PDL", "true")  # was read as off before the one rule
    monkeypatch.setenv("K3_GEMV_FUSED", "split,norm")
    monkeypatch.setenv("K3_KERNELS_SKIP", "moe_route, rms_norm")
    s = settings.KernelSettings.from_env()
    assert s.pdl is True
    assert s.gemv_fused == {"split", "norm"}
    assert s.skip == ("moe_route", "rms_norm")
    monkeypatch.setenv("K3_ALLREDUCE", "ring")
    with pytest.raises(ValueError, match="K3_ALLREDUCE"):
        settings.KernelSettings.from_env()


@pytest.mark.parametrize("value,expected", [(None, 20.0), ("", 20.0), ("0", None), ("off", None),
                                            ("1", 0.0), ("on", 0.0), ("20", 20.0),
                                            ("2.5", 2.5)])
def test_late_trigger_switch(value, expected, monkeypatch):
    """K3_GEMM_TC_LATE_TRIGGER: a boolean (every launch or none) or a weight size in MB."""
    if value is not None:
        monkeypatch.setenv("K3_GEMM_TC_LATE_TRIGGER", value)
    assert settings.KernelSettings.from_env().gemm_tc_late_trigger_mb == expected


@pytest.mark.parametrize("value", ["-3", "big"])
def test_a_bad_late_trigger_is_an_error(value):
    with pytest.raises(ValueError, match="K3_GEMM_TC_LATE_TRIGGER"):
        settings.parse_late_trigger(value)


@pytest.mark.parametrize("value,expected", [(None, 0), ("", 0), ("0", 0), ("off", 0), ("1", 1),
                                            ("on", 1), ("8", 8)])
def test_kda_fb_switch(value, expected, monkeypatch):
    """K3_KDA_FB: a boolean (every bucket or none) or the smallest bucket, in requests."""
    if value is not None:
        monkeypatch.setenv("K3_KDA_FB", value)
    assert settings.KernelSettings.from_env().kda_fb == expected


@pytest.mark.parametrize("value", ["-3", "big", "2.5"])
def test_a_bad_kda_fb_is_an_error(value):
    with pytest.raises(ValueError, match="K3_KDA_FB"):
        settings.parse_min_rows("K3_KDA_FB", value)


def test_options_from_environment(monkeypatch):
    monkeypatch.setenv("K3_SIDE_STREAMS", "off")
    monkeypatch.setenv("K3_VERIFY", "yes")
    opts = settings.Options.make({"strict": True})
    assert (opts.side_streams, opts.verify, opts.strict) == (False, True, True)
    assert settings.Options.make({"side_streams": True}).side_streams is True  # option wins
    monkeypatch.setenv("K3_STRICT", "perhaps")
    with pytest.raises(ValueError, match="K3_STRICT"):
        settings.Options.make()
