"""A tenth spelling of K3 (`tests/models/spell10_k3.py`, written blind as a serving engine's
model file) under backend="k3".

Values (these must pass): the spelling's eager step equals the built-in model's on the same state
dict (fp32, logits and every state, several steps, batch 2, one token and 3 verify rows).
"""

from __future__ import annotations

import pytest

from tests.models.spell10_k3 import from_builtin, state_of
from tests.spellings import foreign

EAGER_TOL = 1e-5  # measured 1.6e-6 (logits, T = 1 and T = 3), states <= 1.1e-6 over 4 steps


@pytest.mark.parametrize("rows", [0, 3])
def test_loads_the_builtin_state_dict_and_equals_it_eagerly(rows):
    foreign.assert_eager_equals_builtin(from_builtin, state_of, EAGER_TOL, rows)
