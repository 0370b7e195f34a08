"""User tools: the graph-diff report (`k3compile diff`)."""
