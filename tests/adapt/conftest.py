"""Tests of `k3compile.adapt` on Moonshot's own code: they need its files (K3_MOONSHOT_DIR, a
folder holding modeling_kimi_linear.py and configuration_kimi_k3.py from the Hugging Face repo
moonshotai/Kimi-K3) and `pip install -e ".[moonshot]"` (transformers, einops); they skip with a
message saying which is missing."""

from __future__ import annotations

import importlib.util

import pytest

from k3compile import settings


def moonshot_missing() -> str | None:
    if not settings.env("K3_MOONSHOT_DIR"):
        return ("K3_MOONSHOT_DIR is not set: point it at a folder holding Moonshot's "
                "modeling_kimi_linear.py and configuration_kimi_k3.py")
    for module in ("transformers", "einops"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e '.[moonshot]')"
    return None


@pytest.fixture(scope="session")
def moonshot():
    if (why := moonshot_missing()) is not None:
        pytest.skip(why)
    from k3compile.adapt import moonshot as loader

    loader.load()
    return loader
