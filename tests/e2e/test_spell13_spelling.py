"""A thirteenth spelling of K3 (`tests/models/spell13_k3.py`, written blind: sequence-first
activations, flat parameter storage, tensordot projections, one-hot state writes, a masked
logsumexp AttnRes, a Householder delta rule, a kthvalue-threshold dense MoE, MXFP4 by a byte
table) under backend="k3".

Values: the spelling's eager step equals the built-in model's on the same state dict (fp32,
logits and every state, 4 steps, batch 2, one token and 3 verify rows)."""

from __future__ import annotations

import pytest

from tests.models.spell13_k3 import from_builtin, state_of
from tests.spellings import foreign

EAGER_TOL = 1e-5  # measured 2.7e-6 (T = 1), 1.9e-6 (T = 3), states <= 1.3e-6 over 4 steps


@pytest.mark.parametrize("rows", (0, 3))
def test_loads_the_builtin_state_dict_and_equals_it_eagerly(rows):
    foreign.assert_eager_equals_builtin(from_builtin, state_of, EAGER_TOL, rows)
