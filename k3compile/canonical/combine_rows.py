"""Rule `combine_rows`: rule `expert_combine` once more, after `token_rows`.

A spelling that keeps the token dim through its FFN ([B, 1, D] at T = 1; tests/models/spell9_k3.py)
and flattens the tokens itself before its experts combines their outputs with the routing
weights on tokens: `einsum("...k,...kd->...d", w [B, T, k], ys.reshape(B, T, k, L))`, a bmm over
[B*T, 1, k] x [B*T, k, L] read back as [B, T, L]. `expert_combine` takes a weighted finalize of
[N, k] weights only, so it leaves this one; `token_rows` then writes the FFN on rows, the
weights [N, k] and the result [N, L], which is the finalize `expert_combine` takes. Written as
its own rule (after token_rows) rather than by moving `expert_combine`: every finalize that
rule took before token_rows is taken as before. What it takes and its checks are
expert_combine's (the weighted sum evaluated against `(w.unsqueeze(-1) * y).sum(1)`, y an FC2
over routed experts).
"""

from __future__ import annotations

from k3compile.canonical import Rule, expert_combine

RULE = Rule("combine_rows", expert_combine.apply,
            "the experts' weighted finalize that token_rows put on rows (a [B, T, k] one before) "
            "-> (w.unsqueeze(-1) * y).sum(1), as expert_combine")
