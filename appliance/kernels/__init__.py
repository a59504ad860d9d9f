"""The kernels' Python side: which compiled module runs (dispatch), the numpy twin of every kernel
(reference), the numeric formats (quant), CPU topology (cpu) and the selftest.

The C sources and the contract header live in the repository's kernels/ directory.
"""
