"""HookRegistry patches of SGLang internals, one file per target.

Each module names the SGLang function it patches and the version it was written
against (0.5.23), and registers its hook from a ``register()`` function that the
plugin calls. No module here is imported by a stock server.
"""

from sgl_mmkv.patches import (  # noqa: E402
    eager_runner_execute_extend,
    forward_batch_positions,
    mm_embed_routine,
    mm_processor_flush,
    model_parallel_group_cpu,
    scheduler_internal_state,
    scheduler_run_batch,
    scheduler_runtime_check,
    tokenizer_caller_hashes,
    weight_updates,
)

__all__ = [
    "scheduler_run_batch",
    "eager_runner_execute_extend",
    "forward_batch_positions",
    "mm_embed_routine",
    "mm_processor_flush",
    "model_parallel_group_cpu",
    "scheduler_internal_state",
    "scheduler_runtime_check",
    "tokenizer_caller_hashes",
    "weight_updates",
]
