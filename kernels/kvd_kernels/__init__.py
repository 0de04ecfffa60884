"""Pallas kernels: pure functions over arrays, importing nothing from kvd (kernels/README.md)."""
