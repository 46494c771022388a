"""Triton kernels (and FlashInfer adapters) with their torch references."""
