"""k3compile: a torch.compile backend for Kimi K3 decode (`backend="k3"`)."""

from pathlib import Path

# In a source checkout without `pip install`, patterns/ and kernels/ sit beside this package; let
# `k3compile.patterns` / `k3compile.kernels` resolve there, as they do in an installed wheel.
_root = Path(__file__).resolve().parent.parent
if (_root / "patterns" / "__init__.py").exists() and not (Path(__file__).parent / "patterns").exists():
    __path__.append(str(_root))

__version__ = "0.1.0"

from k3compile.adapt import adapt  # noqa: E402  (Moonshot's model as the decode step)
