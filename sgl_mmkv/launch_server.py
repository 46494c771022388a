"""``python -m sgl_mmkv.launch_server``: SGLang's server with sgl_mmkv's flags.

Every stock ``sglang.launch_server`` flag is accepted and passed through. Ours are
made from :class:`~sgl_mmkv.config.MMKVConfig`'s fields (:func:`build_parser`):
``python -m sgl_mmkv.launch_server --help`` lists them, and the README's flag table
(checked against the config by ``tests/test_architecture_doc.py``) explains them.

On a machine without CUDA the launcher adds ``--device cpu --attention-backend
torch_native`` unless given, and the environment SGLang needs on the CPU; with more
than one CPU rank (``--tp-size 2``) it splits the cores between them
(``SGLANG_CPU_OMP_THREADS_BIND``) unless the user did, and the plugin's CPU hook
runs the ranks' all-reduces over gloo.
A bad sgl_mmkv flag, or a setting or model the mode does not support
(``sgl_mmkv.support``, read from SGLang's resolved configuration), exits with
status 2 and a one-line reason before anything starts. The scheduler runs the
same checks again where it builds the cache.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from sgl_mmkv.config import (
    RADIX_CACHE_BACKEND_NAME,
    ConfigError,
    MMKVConfig,
    export_config,
    flag_name,
)
from sgl_mmkv.plugin import verify_hooks
from sgl_mmkv.support import check_server_args, check_startup, effective_settings


def build_parser() -> argparse.ArgumentParser:
    """sgl_mmkv's flags, one per :class:`MMKVConfig` field; stock flags pass through."""
    parser = argparse.ArgumentParser(
        prog="python -m sgl_mmkv.launch_server",
        description="SGLang server with a modality-aware KV cache. "
        "All `python -m sglang.launch_server` flags are accepted as well.",
        add_help=False,
    )
    for spec in fields(MMKVConfig):
        flag, what = flag_name(spec.name), spec.metadata["help"]
        choices: dict[str, str] | None = spec.metadata["choices"]
        if choices is not None:
            described = "; ".join(f"{name}: {text}" for name, text in choices.items())
            parser.add_argument(
                flag,
                default=spec.default,
                metavar="{" + ",".join(choices) + "}",
                help=f"{what} (default %(default)s). {described}",
            )
        elif isinstance(spec.default, bool):
            parser.add_argument(flag, action="store_true", help=what)
        else:
            parser.add_argument(
                flag,
                type=spec.metadata.get("parse") or type(spec.default),
                default=spec.default,
                metavar=spec.metadata.get("metavar") or "R",
                help=f"{what} (default %(default)s)",
            )
    parser.add_argument("-h", "--help", action="store_true")
    return parser


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def resolve_args(argv: list[str]) -> tuple[MMKVConfig, list[str]]:
    """Split ``argv`` into sgl_mmkv's config and the argument list for SGLang.

    Raises:
        ConfigError: an sgl_mmkv flag is invalid or conflicts with a stock flag.
    """
    parser = build_parser()
    ours, sglang_argv = parser.parse_known_args(argv)
    config = MMKVConfig(**{spec.name: getattr(ours, spec.name) for spec in fields(MMKVConfig)})
    sglang_argv = list(sglang_argv)

    if config.uses_mmkv_cache:
        allowed = os.environ.get("SGLANG_PLUGINS", "")
        if allowed and "sgl_mmkv" not in {p.strip() for p in allowed.split(",")}:
            raise ConfigError(
                f"SGLANG_PLUGINS={allowed!r} excludes the sgl_mmkv plugin, which "
                f"--mm-reuse {config.mm_reuse} needs in the scheduler; add sgl_mmkv to it"
            )
        backend = _flag_value(sglang_argv, "--radix-cache-backend")
        if backend not in (None, RADIX_CACHE_BACKEND_NAME):
            raise ConfigError(
                f"--mm-reuse {config.mm_reuse} runs sgl_mmkv's radix cache; "
                f"it cannot be combined with --radix-cache-backend {backend}"
            )
        if _has_flag(sglang_argv, "--disable-radix-cache"):
            raise ConfigError(
                f"--mm-reuse {config.mm_reuse} needs the radix cache; "
                "drop --disable-radix-cache or use --mm-reuse off"
            )
        if backend is None:
            sglang_argv += ["--radix-cache-backend", RADIX_CACHE_BACKEND_NAME]
    if config.compresses_at_decode or config.reuses_with_holes:
        page_size = _flag_value(sglang_argv, "--page-size")
        if page_size not in (None, "1"):
            raise ConfigError(
                f"--mm-reuse {config.mm_reuse} with rows that shrink after prefill "
                "(--mm-compress-at decode, or --mm-compressed-reuse holes, the default with "
                f"a scored --mm-evict) frees single slots and needs --page-size 1, got "
                f"--page-size {page_size}; or set --mm-compressed-reuse recompute and "
                "--mm-compress-at pressure or fill"
            )
    return config, sglang_argv


def apply_device_defaults(sglang_argv: list[str], cuda: bool) -> list[str]:
    """Add CPU defaults when there is no GPU and the user did not choose."""
    argv = list(sglang_argv)
    if not cuda and not _has_flag(argv, "--device"):
        argv += ["--device", "cpu"]
    device = _flag_value(argv, "--device")
    if device == "cpu" and not _has_flag(argv, "--attention-backend"):
        argv += ["--attention-backend", "torch_native"]
    return argv


OMP_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def _cpu_list(cores: list[int]) -> str:
    """``cores`` as SGLang's CPU lists write them: ``0-3`` when contiguous, else ``0,2``."""
    if cores == list(range(cores[0], cores[-1] + 1)) and len(cores) > 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def cpu_thread_binding(ranks: int, cores: list[int]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU ranks over ``cores``: the cores
    split into ``ranks`` contiguous groups (``0|1`` for 2 ranks on 2 cores), or one
    core each, shared round robin, when there are fewer cores than ranks."""
    cores = sorted(cores)
    if len(cores) < ranks:
        return "|".join(str(cores[rank % len(cores)]) for rank in range(ranks))
    share, extra = divmod(len(cores), ranks)
    groups, start = [], 0
    for rank in range(ranks):
        end = start + share + (rank < extra)
        groups.append(_cpu_list(cores[start:end]))
        start = end
    return "|".join(groups)


def cpu_ranks(server_args) -> int:
    """The ranks SGLang binds to CPU cores (dp x tp x pp); 0 off the CPU."""
    if server_args.device != "cpu":
        return 0
    return server_args.dp_size * server_args.tp_size * server_args.pp_size


def bind_cpu_ranks(server_args) -> str | None:
    """On the CPU with more than one rank, set ``SGLANG_CPU_OMP_THREADS_BIND`` unless
    the user did: without it SGLang 0.5.23 asserts that its ranks (dp x tp x pp) are
    no more than the machine's NUMA nodes. Returns the line logged, or None."""
    ranks = cpu_ranks(server_args)
    if ranks <= 1 or os.environ.get(OMP_BIND_ENV):
        return None
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = cores or list(range(os.cpu_count() or 1))
    binding = cpu_thread_binding(ranks, cores)
    os.environ[OMP_BIND_ENV] = binding
    shared = " (fewer cores than ranks: ranks share cores)" if len(cores) < ranks else ""
    return (
        f"sgl_mmkv: {OMP_BIND_ENV}={binding}: {ranks} CPU ranks (tp {server_args.tp_size}, "
        f"pp {server_args.pp_size}, dp {server_args.dp_size}) over cores "
        f"{_cpu_list(cores)}{shared}; SGLang otherwise asserts ranks <= NUMA nodes "
        f"(set {OMP_BIND_ENV} to choose)"
    )


def check_segment_storage(config: MMKVConfig) -> None:
    """Open the ``--mm-segment-storage`` backend once before the server starts, so a
    backend that cannot be created or does not keep tensors exits with one line.

    Raises:
        StorageError: as :func:`sgl_mmkv.segments.storage.open_storage`.
    """
    from sgl_mmkv.segments.storage import KVFingerprint, open_storage

    open_storage(
        config.mm_segment_storage,
        KVFingerprint("launcher probe", "", 0, 0, 0, 0),
        config.mm_segment_storage_dir or None,
        config.storage_extra_config(),
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        config, sglang_argv = resolve_args(argv)
    except ConfigError as exc:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if parser.parse_known_args(argv)[0].help:
        parser.print_help()
        print("\nStock SGLang flags follow.\n")
        sglang_argv = ["--help"]

    from sgl_mmkv.cpu_support import cuda_available, prepare_cpu_process

    sglang_argv = apply_device_defaults(sglang_argv, cuda=cuda_available())
    if _flag_value(sglang_argv, "--device") == "cpu":
        prepare_cpu_process()
    export_config(config)

    # Imported only now: SGLang reads the environment prepared above at import.
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sglang_argv)
    binding = bind_cpu_ranks(server_args)
    if binding:
        print(binding, file=sys.stderr, flush=True)
    try:
        # Several CPU ranks need the CPU tensor-parallel hook, whatever the mode.
        if config.uses_mmkv_cache or cpu_ranks(server_args) > 1:
            verify_hooks()
            check_server_args(config, server_args)  # what was asked, before SGLang resolves
            check_startup(config, *effective_settings(server_args))
        if config.uses_segment_storage:
            check_segment_storage(config)
    except (ConfigError, RuntimeError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
