"""The Kimi K3 reference model (decode), its configs and its checkpoint loader."""

from k3compile.models.config import CONFIGS, K3Config, get_config
from k3compile.models.k3 import K3ForCausalLM, build_model

__all__ = ["CONFIGS", "K3Config", "K3ForCausalLM", "build_model", "get_config"]
