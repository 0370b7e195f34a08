"""User tools: the graph-diff report (`k3compile diff`, `k3compile.tools.diff`) and timed greedy
decoding under eager, Inductor and k3 (`k3compile generate`, `k3compile.tools.generate`)."""
