"""Moved to `k3compile/models/hf_k3.py` (the yardstick builds it); kept for imports elsewhere."""

from k3compile.models.hf_k3 import *
from k3compile.models.hf_k3 import __all__  # noqa: F401
