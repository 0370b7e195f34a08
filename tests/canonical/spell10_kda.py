"""spell10's KDA step with one idiom in its blind spelling and the others switched (its probes,
`Spell10K3.set_probe`) to spellings the backend fuses: whether the KDA step fuses then is whether
a rule closes that idiom (docs/spell10_spelling.md). Compiled under backend k3 (executor aten),
checked against its own eager copy."""

from __future__ import annotations

import torch

from tests.conftest import TOL
from tests.models.spell10_k3 import from_builtin
from tests.spellings import foreign

KDA_PROBES = ("conv1d", "kda_split_rows", "kda_split_int", "decay_per_head", "kda_o_rows",
              "beta_sigmoid", "q_scale_after", "kda_cast_pieces")


def kda_plan_with_only(idiom: str | None, dtype=torch.float32,
                       rows: int = 0) -> dict[int, dict[str, int]]:
    """The k3 ops of layers 0 and 1 (KDA) of spell10 compiled with every KDA probe but
    `idiom`'s on (None: every probe off, the blind spelling), `rows` verify rows a request (0:
    one token); asserts the compiled step equals eager within TOL."""
    probes = () if idiom is None else tuple(p for p in KDA_PROBES if p != idiom)
    builtin = foreign.builtin(dtype)
    model, eager = (from_builtin(builtin).set_probe(*probes) for _ in range(2))
    tol = TOL["aten_cpu"] if dtype == torch.float32 else TOL["diffsuite_bf16"]
    assert foreign.steps(foreign.compile_k3(model), eager, n=1, rows=rows) <= tol
    got = foreign.per_layer(foreign.last_compiled())
    return {layer: dict(got[layer]) for layer in (0, 1)}


def assert_kda_fuses_with_only(idiom: str, dtype=torch.float32) -> None:
    for layer, ops in kda_plan_with_only(idiom, dtype).items():
        assert ops.get("fb_kda_decode") == 1 and ops.get("linear_concat") == 1, (layer, ops)
