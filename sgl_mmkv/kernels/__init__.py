"""Triton kernels with their torch references (``reference.py``); the torch paths run
where Triton does not, and by default for attention (see each module's docstring)."""
