"""Stock ``python -m sglang.launch_server`` with sgl_mmkv's CPU tensor-parallel hook
and nothing else: ``python -m sgl_mmkv.testing.stock_tp_server <sglang flags>``.

Stock SGLang 0.5.23 cannot run ``--tp-size 2`` on the CPU (its groups build a
``PyNcclCommunicator``, which needs CUDA). sgl_mmkv's plugin registers its fix
(``sgl_mmkv/patches/model_parallel_group_cpu.py``) only in a server that
``sgl_mmkv.launch_server`` started; a stock launch keeps it off, so stock stays
stock. This wrapper registers the same hook, then runs SGLang's own launcher. The
hook reaches the scheduler processes because SGLang spawns them: a spawned child
imports the parent's main module (this one) before it loads plugins and applies
hooks. ``SGLANG_CPU_OMP_THREADS_BIND`` is left to the caller.
"""

from __future__ import annotations

import runpy

from sgl_mmkv.patches import model_parallel_group_cpu

model_parallel_group_cpu.register()

if __name__ == "__main__":
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)
