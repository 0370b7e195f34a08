"""User tools: the graph-diff report (`k3compile diff`, `k3compile.tools.diff`)."""
