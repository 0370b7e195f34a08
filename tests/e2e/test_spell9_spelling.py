"""A ninth spelling of K3 (`tests/models/spell9_k3.py`, a JAX/Flax port written blind from the
spec) under backend="k3".

Values (these must pass): the spelling's eager step equals the built-in model's on the same state
dict (fp32, logits and every state, several steps, batch 2, one token and 3 verify rows).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err
from tests.models.spell9_k3 import from_builtin, state_of
from tests.spellings.foreign import builtin as _builtin
from tests.spellings.foreign import builtin_states as _builtin_states
from tests.spellings.foreign import steps as _steps

EAGER_TOL = 1e-5  # measured 3.1e-6 (logits, T = 1), 2.8e-6 (T = 3), states <= 1.9e-6 over 4 steps


@pytest.mark.parametrize("rows", [0, 3])
def test_loads_the_builtin_state_dict_and_equals_it_eagerly(rows):
    ref = _builtin(torch.float32)
    spelled = from_builtin(ref)
    err = _steps(spelled, ref, n=4, rows=rows)
    assert err <= EAGER_TOL, err
    want, got = _builtin_states(ref), state_of(spelled)
    assert set(got) == set(want) and len(want) == 6
    for name, t in want.items():
        assert rel_err(got[name], t) <= EAGER_TOL, name
