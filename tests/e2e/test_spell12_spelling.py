"""A twelfth spelling of K3 (`tests/models/spell12_k3.py`, written blind as a stateless
functional model: a meta-device skeleton run by `torch.func.functional_call` over a flat dict of
weights, states passed in and returned) under backend="k3" (docs/spell12_spelling.md).

Values: the spelling's eager step equals the built-in model's on the same state dict (fp32,
logits and every state, 4 steps, batch 2, one token and 3 verify rows)."""

from __future__ import annotations

from tests.models.spell12_k3 import from_builtin, state_of
from tests.spellings import foreign

EAGER_TOL = 1e-5  # measured 1.2e-6 (T = 1), 1.1e-6 (T = 3), states <= 1.0e-6 over 4 steps


def test_loads_the_builtin_state_dict_and_equals_it_eagerly():
    for rows in (0, 3):
        foreign.assert_eager_equals_builtin(from_builtin, state_of, EAGER_TOL, rows)
