"""The pipeline's stages, one module each; each is a `graph -> graph` function over the functional
ATen graph (`k3compile.pipeline` lists them in order)."""
