"""Stage `check`: the rewrite engine's invariants and the side-stream schedule, on the graph every
earlier stage made. A violation fails the compile (AssertionError, naming the node).

* every call has `meta["val"]`;
* the graph is functional except for the declared state: an op that writes an argument in place
  (`Tensor(a!)` in its schema) writes a graph input;
* `streams.hazards`: no buffer read on one stream while another writes it without an event
  between, collectives on the main stream, every op's stream argument its `k3_stream`.
"""

from __future__ import annotations

from torch import fx

from k3compile.stages.streams import hazards


class InvariantError(AssertionError):
    pass


def check(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    problems = invariants(gm.graph) + hazards(gm.graph)
    if problems:
        raise InvariantError("k3compile invariant: " + "; ".join(problems[:10])
                             + (f"; ... ({len(problems)} in all)" if len(problems) > 10 else ""))
    return gm


def invariants(graph: fx.Graph) -> list[str]:
    out = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if "val" not in node.meta:
            out.append(f"node {node.name} has no meta['val']")
        if getattr(node.target, "_schema", None) is not None:
            for target in written_args(node):
                if isinstance(target, fx.Node) and target.op != "placeholder":
                    out.append(f"{node.name} mutates a non-input ({target.name})")
    return out


def written_args(node: fx.Node) -> list:
    """The arguments a call writes to, by its schema (`Tensor(a!)`)."""
    out = []
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name))
    return out
