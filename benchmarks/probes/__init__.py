"""One-off probes: each explored one question once (the answers are dated in ../LOG.md).

Kept so that an entry of the log can be rerun, not maintained as the harness is. Run from the
repository root as `python -m benchmarks.probes.NAME` (copy_variants.cu is a standalone CUDA
program: its header gives the nvcc line).
"""
