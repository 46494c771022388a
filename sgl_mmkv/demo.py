"""``python -m sgl_mmkv.demo``: build the tiny VLM, serve it, send a multi-image request.

Starts ``python -m sgl_mmkv.launch_server --mm-reuse exact`` on the embedded tiny
Qwen2-VL (built offline on first use), sends the same two-image chat request twice
through the OpenAI client, prints the answers and the cached-token counts, then
stops the server. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_MODEL_DIR = Path("models/tiny-qwen2-vl")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--mm-reuse", default="exact")
    args = parser.parse_args(argv)

    from sgl_mmkv.cpu_support import prepare_cpu_process

    prepare_cpu_process()
    import openai

    from sgl_mmkv.testing.images import make_image, user_message
    from sgl_mmkv.testing.make_tiny_model import make_tiny_model
    from sgl_mmkv.testing.server import CPU_SERVER_ARGS, ServerProcess

    if not (args.model_path / "config.json").exists():
        print(f"[demo] building the tiny Qwen2-VL in {args.model_path}")
        make_tiny_model("qwen2_vl", args.model_path, seed=0)

    server = ServerProcess(
        "sgl_mmkv.launch_server",
        args.model_path,
        ["--mm-reuse", args.mm_reuse, *CPU_SERVER_ARGS],
    )
    print("[demo] $ python", " ".join(server.command[1:]))
    started = time.monotonic()
    with server:
        print(f"[demo] server ready in {time.monotonic() - started:.1f} s (log: {server.log_path})")
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        messages = [user_message("Compare the two images.", [make_image(1), make_image(2)])]
        for attempt in ("first", "repeat"):
            t0 = time.monotonic()
            reply = client.chat.completions.create(
                model="default", messages=messages, max_tokens=16, temperature=0
            )
            details = reply.usage.prompt_tokens_details
            print(
                f"[demo] {attempt}: {time.monotonic() - t0:.2f} s, "
                f"prompt_tokens={reply.usage.prompt_tokens} image_tokens={details.image_tokens} "
                f"cached_tokens={details.cached_tokens}\n       answer: "
                f"{reply.choices[0].message.content!r}"
            )
    print("[demo] server stopped (random weights: the answer text is not meaningful)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
