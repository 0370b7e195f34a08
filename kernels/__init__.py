"""CuTe DSL kernels, one per file; each is the CUDA implementation of a `k3` op."""
