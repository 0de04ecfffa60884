"""The engine's Pallas TPU kernels (see README.md here)."""
