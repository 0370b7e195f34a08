"""The CuTe DSL kernel classes, at module level (importable and testable on their own): one
module per host file, named like it. Every module here imports `cutlass`; the host wrappers import
them lazily in their `build`."""
