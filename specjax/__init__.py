"""specjax: exact speculative decoding in JAX (Bebop MTP + TV losses, DSpark drafters + scheduler)."""

__version__ = "0.1.0"
