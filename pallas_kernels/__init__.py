"""Pallas kernels for specjax, each with a jnp reference in the same module.

- :mod:`pallas_kernels.rejection_sampling`: batched rejection sampling (TPU Mosaic, GPU Triton).
"""
