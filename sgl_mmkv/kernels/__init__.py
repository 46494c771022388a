"""Triton kernels with their torch references (``reference.py``); the torch paths run
where Triton does not (see each module's docstring). On CUDA the refresh attention
and gather-and-rotate run Triton; the attention-mass reduction runs torch unless
``SGL_MMKV_TRITON_ATTENTION=1``."""
