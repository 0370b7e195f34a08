"""Device helpers shared by the kernels."""
