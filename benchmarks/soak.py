"""Soak a ``--mm-reuse conduit`` server with every feature and request shape at once.

    python benchmarks/soak.py --requests 1000 --concurrency 8 --out-dir benchmarks/results/soak

The server runs with everything on: CONDUIT refresh, SnapKV compression at fill with
reuse holes (kept 0.5), small prefill chunks (64 tokens) under SGLang's overlap
scheduler, a KV pool smaller than the images in play (memory pressure), an L3
segment storage directory, and every freed or hole slot NaN-poisoned
(``SGL_MMKV_POISON_FREED=1``: a read of a slot no request wrote spreads NaN).

Mixed traffic on the tiny VLM: image reuse under new prefixes and orders, images
after a long text (their last chunk reuses them with holes), exact repeats, two-turn
chats, session turns, text-only chats, prompt logprobs (OpenAI echo), ``n > 1``,
streams whose client disconnects after the first chunk, aborted requests, broken,
1x1 and huge images, prompts longer than the context, cache flushes during traffic,
several ``cache_salt`` tenants. Then a deterministic subset (text chats and chats
about new images, greedy) is sent one at a time to the soaked server and to a stock
server at its defaults, one server up at a time.

Pass: the server never dies, every valid request gets 200, every invalid one a
4xx, the deterministic subset equals stock's replies, and after a flush the pool
is whole again with no slot freed twice. Prints a table (kind x outcome), writes
``soak.json``; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: harness/

from harness.servers import stock_launch
from sgl_mmkv.cpu_support import prepare_cpu_process
from sgl_mmkv.segments.poison import POISON_ENV
from sgl_mmkv.testing.images import data_url, make_image, user_message
from sgl_mmkv.testing.server import (
    CPU_SERVER_ARGS,
    REPORT_REUSE,
    ServerProcess,
    flush_cache,
    mmkv_stats,
    stock_cpu_env,
)

# kind -> (weight, what a correct answer is: "ok" = 200, "4xx", "ok|4xx")
KINDS: dict[str, tuple[int, str]] = {
    "reuse_new_prefix": (6, "ok"),
    "reordered": (3, "ok"),
    "exact_repeat": (2, "ok"),
    "multi_turn": (2, "ok"),
    "long_prefix": (3, "ok"),
    "session": (1, "ok"),
    "salted": (2, "ok"),
    "text_only": (3, "ok"),
    "prompt_logprobs": (2, "ok"),
    "n_two": (1, "ok"),
    "stream_disconnect": (1, "ok"),
    "abort": (1, "ok"),
    "tiny_image": (1, "ok"),
    "huge_image": (1, "ok|4xx"),
    "broken_image": (1, "4xx"),
    "too_long": (1, "4xx"),
    "flush": (1, "ok|4xx"),
}
POOL_TOKENS = 1200  # 16 tokens per image; 24 images in play hold 384, and rows more
CHUNK_TOKENS = 64  # long-prefix requests reach their images in a later chunk
EVICTION_FLAGS = ["--mm-evict", "snapkv", "--mm-kv-budget", "0.5", "--mm-compress-at", "fill"]
SERVER_FLAGS = [
    *("--mm-reuse", "conduit", "--mm-reuse-gate", "always", REPORT_REUSE),
    *EVICTION_FLAGS,
    *("--chunked-prefill-size", str(CHUNK_TOKENS), "--enable-streaming-session"),
    *("--max-total-tokens", str(POOL_TOKENS)),
]


def server_flags(tp_size: int) -> list[str]:
    """The soaked server's flags: every feature on, at ``tp_size`` ranks."""
    if tp_size <= 1:
        return list(SERVER_FLAGS)
    return [*SERVER_FLAGS, "--tp-size", str(tp_size)]


class Soak:
    """One server's traffic; every reply's outcome is recorded by kind."""

    def __init__(self, base_url: str, seed: int, context_len: int) -> None:
        self.url = base_url
        self.rng = random.Random(seed)
        self.images = [data_url(make_image(2000 + i)) for i in range(24)]
        self.context_len = context_len
        self.sent: list[list[dict]] = []
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.failures: list[str] = []

    # -- requests ------------------------------------------------------------------------

    def _image_part(self, url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    def _messages(self, system: str, urls: list[str], question: str) -> list[dict]:
        content = [self._image_part(u) for u in urls] + [{"type": "text", "text": question}]
        return [{"role": "system", "content": system}, {"role": "user", "content": content}]

    def _chat(self, messages: list[dict], **extra) -> requests.Response:
        body = {"model": "default", "messages": messages, "max_tokens": 4, "temperature": 0}
        return requests.post(self.url + "/v1/chat/completions", json={**body, **extra}, timeout=600)

    def request(self, kind: str, i: int) -> requests.Response:
        """Send one request of ``kind``; returns its response."""
        rng = random.Random(self.rng.random())
        urls = rng.sample(self.images, rng.randint(1, 3))
        system = f"System prompt {uuid.uuid4().hex[:8]} for request {i}."
        if kind in ("reuse_new_prefix", "salted"):
            extra = {"cache_salt": rng.choice(["tenant-a", "tenant-b"])} if kind == "salted" else {}
            messages = self._messages(system, urls, "What do you see?")
            self.sent.append(messages)
            return self._chat(messages, **extra)
        if kind == "reordered":
            return self._chat(self._messages(system, urls[::-1], "Describe them."))
        if kind == "exact_repeat":
            messages = rng.choice(self.sent) if self.sent else self._messages(system, urls, "Hi.")
            return self._chat(messages)
        if kind == "multi_turn":
            first = self._messages(system, urls, "Look at these.")
            r = self._chat(first)
            if r.status_code != 200:
                return r
            answer = r.json()["choices"][0]["message"]["content"]
            turn = [{"role": "assistant", "content": answer}, user_message("And now?", [])]
            return self._chat(first + turn)
        if kind == "long_prefix":
            words = " ".join(f"w{i}x{j}" for j in range(rng.randint(40, 90)))
            return self._chat(self._messages(system, urls, words + " What do you see?"))
        if kind == "session":
            return self._session(system, urls)
        if kind == "text_only":
            return self._chat([{"role": "user", "content": f"Count to {i % 50} please."}])
        if kind == "prompt_logprobs":
            body = {"model": "default", "prompt": f"Numbers {i}: one two three", "max_tokens": 2}
            body |= {"echo": True, "logprobs": 3, "temperature": 0}
            return requests.post(self.url + "/v1/completions", json=body, timeout=600)
        if kind == "n_two":  # stock SGLang answers n > 1 with several images with a 400
            return self._chat(self._messages(system, urls[:1], "Two takes."), n=2)
        if kind == "stream_disconnect":
            with self._stream(self._messages(system, urls, "Go on.")) as r:
                next(r.iter_lines(), None)  # then the client goes away
                return r
        if kind == "abort":
            return self._abort(system, urls[0])
        if kind == "tiny_image":
            tiny = "data:image/png;base64," + base64.b64encode(_png(1)).decode()
            return self._chat(self._messages(system, [tiny], "Tiny?"))
        if kind == "huge_image":
            huge = "data:image/png;base64," + base64.b64encode(_png(1600)).decode()
            return self._chat(self._messages(system, [huge], "Huge?"))
        if kind == "broken_image":
            broken = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
            return self._chat(self._messages(system, [broken], "Broken?"))
        if kind == "too_long":
            words = " ".join(["word"] * (self.context_len + 64))
            return self._chat([{"role": "user", "content": words}])
        if kind == "flush":
            return requests.post(self.url + "/flush_cache", timeout=600)
        raise ValueError(kind)

    def _stream(self, messages: list[dict]) -> requests.Response:
        body = {"model": "default", "messages": messages, "max_tokens": 16, "stream": True}
        return requests.post(self.url + "/v1/chat/completions", json=body, stream=True, timeout=600)

    def _session(self, system: str, urls: list[str]) -> requests.Response:
        """Two turns in a session (streaming or not) that show stored images."""
        streaming = self.rng.random() < 0.5
        body = {"capacity_of_str_len": 100000, "streaming": streaming}
        opened = requests.post(self.url + "/open_session", json=body, timeout=600)
        if opened.status_code != 200:
            return opened
        session, rid, response = opened.json(), None, opened
        try:
            for turn in range(2):
                body = {
                    "text": f"{system} Turn {turn}."
                    + "<|vision_start|><|image_pad|><|vision_end|>" * len(urls),
                    "image_data": urls,
                    "sampling_params": {"max_new_tokens": 4, "temperature": 0},
                    "session_params": {"id": session, "rid": rid},
                }
                response = requests.post(self.url + "/generate", json=body, timeout=600)
                if response.status_code != 200:
                    return response
                rid = response.json()["meta_info"]["id"]
        finally:
            requests.post(self.url + "/close_session", json={"session_id": session}, timeout=600)
        return response

    def _abort(self, system: str, url: str) -> requests.Response:
        rid = uuid.uuid4().hex
        body = {
            "rid": rid,
            "text": f"{system} Describe the picture in detail.",
            "image_data": [url],
            "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
        }
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(requests.post, self.url + "/generate", json=body, timeout=600)
            time.sleep(0.05)
            requests.post(self.url + "/abort_request", json={"rid": rid}, timeout=60)
            return future.result()

    # -- the run -------------------------------------------------------------------------

    def one(self, kind: str, i: int) -> None:
        try:
            response = self.request(kind, i)
        except requests.RequestException as exc:
            status, detail = 599, repr(exc)[:200]
        else:
            status, detail = response.status_code, ""
            if status != 200:
                detail = response.text[:300]
        outcome = "ok" if status == 200 else ("4xx" if 400 <= status < 500 else f"{status}")
        self.outcomes[kind][outcome] += 1
        expected = KINDS[kind][1].split("|")
        if outcome not in expected:
            self.failures.append(f"request {i} ({kind}): {outcome} {detail}".strip())

    def run(self, count: int, concurrency: int) -> float:
        kinds = list(KINDS)
        weights = [KINDS[k][0] for k in kinds]
        plan = self.rng.choices(kinds, weights, k=count)
        places = self.rng.sample(range(count), min(count, len(kinds)))
        for kind, i in zip(kinds, places, strict=False):
            plan[i] = kind  # every kind at least once (a place each)
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(self.one, plan, range(count)))
        return time.perf_counter() - started


def _png(size: int) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def probes(count: int) -> list[list[dict]]:
    """The deterministic subset: text chats and chats about images no soak request
    used, sent one at a time after the soak (nothing to reuse: stock's own path)."""
    out = []
    for j in range(count):
        if j % 2:
            out.append([{"role": "user", "content": f"Probe {j}: count to {j} please."}])
        else:
            out.append([user_message(f"Probe {j}: what is this?", [make_image(5000 + j)])])
    return out


def greedy_replies(base_url: str, conversations: list[list[dict]]) -> list[str]:
    replies = []
    for messages in conversations:
        body = {"model": "default", "messages": messages, "max_tokens": 6, "temperature": 0}
        r = requests.post(base_url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        replies.append(r.json()["choices"][0]["message"]["content"])
    return replies


def stock_args(tp_size: int) -> list[str]:
    """Stock SGLang's arguments: the CPU settings at its defaults, at the same TP size."""
    return [*CPU_SERVER_ARGS, *(("--tp-size", str(tp_size)) if tp_size > 1 else ())]


def stock_replies(
    model: Path, conversations: list[list[dict]], log: Path, tp_size: int = 1
) -> list[str]:
    module, env = stock_launch(stock_args(tp_size))
    with ServerProcess(module, model, stock_args(tp_size), log, env=env) as server:
        return greedy_replies(server.base_url, conversations)


def format_table(outcomes: dict[str, Counter]) -> str:
    columns = sorted({o for c in outcomes.values() for o in c})
    lines = ["| kind | expected | " + " | ".join(columns) + " |"]
    lines.append("|---|---|" + "---|" * len(columns))
    for kind in KINDS:
        row = [str(outcomes[kind].get(c, 0)) for c in columns]
        lines.append(f"| {kind} | {KINDS[kind][1]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=None, help="default: tiny VLM")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probes", type=int, default=16, help="deterministic subset size")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results/soak"))
    parser.add_argument("--tp-size", type=int, default=1, help="ranks of both servers")
    args = parser.parse_args(argv)
    prepare_cpu_process()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model = args.model_path
    if model is None:
        from sgl_mmkv.testing.make_tiny_model import make_tiny_model

        model = Path(tempfile.mkdtemp()) / "tiny-qwen2-vl"
        make_tiny_model("qwen2_vl", model, seed=0)

    storage = Path(tempfile.mkdtemp(prefix="soak-storage-"))
    flags = [
        *server_flags(args.tp_size),
        "--mm-segment-storage",
        "file",
        "--mm-segment-storage-dir",
        str(storage),
    ]
    shared = [a for a in CPU_SERVER_ARGS]
    shared[shared.index("--max-total-tokens") : shared.index("--max-total-tokens") + 2] = []
    server = ServerProcess(
        "sgl_mmkv.launch_server",
        model,
        [*shared, *flags],
        args.out_dir / "soak_server.log",
        env={**stock_cpu_env(), POISON_ENV: "1"},
    )
    command = "python " + " ".join(server.command[1:])
    with server:
        info = requests.get(server.base_url + "/get_server_info", timeout=60).json()
        context_len = int(info.get("max_req_input_len") or info.get("context_length") or 4096)
        soak = Soak(server.base_url, args.seed, context_len)
        wall = soak.run(args.requests, args.concurrency)
        alive = requests.get(server.base_url + "/health", timeout=60).status_code == 200
        subset = probes(args.probes)
        ours = greedy_replies(server.base_url, subset) if alive else []
        flush_cache(server.base_url)
        stats = mmkv_stats(server.base_url)
    pool = stats["pool"]
    ledger_ok = pool["available"] == pool["size"] and pool["free_unique"] and pool["in_use"] == 0
    stock = stock_replies(model, subset, args.out_dir / "stock_server.log", args.tp_size)
    differing = [j for j, (a, b) in enumerate(zip(ours, stock, strict=False)) if a != b]
    differing += list(range(len(ours), len(stock)))

    failures = list(soak.failures)
    if not alive:
        failures.append("the server died")
    if not ledger_ok:
        failures.append(f"pool not whole after a flush: {pool}")
    failures += [f"probe {j} differs from stock" for j in differing]
    table = format_table(soak.outcomes)
    print(table)
    print(
        f"\n{args.requests} requests at concurrency {args.concurrency} in {wall:.1f} s; "
        f"server alive: {alive}; pool after flush: {pool}; "
        f"probes equal to stock: {len(stock) - len(differing)}/{len(stock)}; "
        f"refresh counters: {stats['refresh']}; row compaction: {stats.get('row_compaction')}; "
        f"storage: {stats.get('storage')}"
    )
    print(f"server: {command} (env {POISON_ENV}=1)")
    stock_module, stock_env = stock_launch(stock_args(args.tp_size))
    bind = " ".join(f"{k}={v}" for k, v in (stock_env or {}).items() if k.startswith("SGLANG_CPU"))
    print(
        f"stock:  {bind + ' ' if bind else ''}python -m {stock_module} --model-path {model} "
        f"{' '.join(stock_args(args.tp_size))}"
    )
    record = {
        "command": " ".join(sys.argv),
        "server_command": command,
        "requests": args.requests,
        "tp_size": args.tp_size,
        "concurrency": args.concurrency,
        "wall_s": wall,
        "alive": alive,
        "pool_after_flush": pool,
        "outcomes": {k: dict(v) for k, v in soak.outcomes.items()},
        "probes_compared": len(stock),
        "probes_differing": differing,
        "refresh": stats["refresh"],
        "store": stats["store"],
        "row_compaction": stats.get("row_compaction"),
        "storage": stats.get("storage"),
        "failures": failures,
    }
    (args.out_dir / "soak.json").write_text(json.dumps(record, indent=2))
    (args.out_dir / "soak.md").write_text(table + "\n")
    for failure in failures[:20]:
        print("FAIL:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
