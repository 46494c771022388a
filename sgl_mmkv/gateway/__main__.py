"""``python -m sgl_mmkv.gateway``: the image-affinity gateway in front of SGLang's router.

    python -m sgl_mmkv.gateway --router-url http://127.0.0.1:30000 --port 30080

Clients send their requests to the gateway; it sets ``X-SMG-Routing-Key`` from the
images and forwards to the router (started with ``--policy manual``). A bad flag
exits with status 2 and one line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from sgl_mmkv.gateway.proxy import Gateway, GatewayConfig, parse_router_url


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    defaults = GatewayConfig("127.0.0.1", 80)
    parser = argparse.ArgumentParser(
        prog="python -m sgl_mmkv.gateway",
        description="The image-affinity gateway in front of SGLang's router: sets "
        "X-SMG-Routing-Key from each request's images.",
    )
    parser.add_argument("--router-url", required=True, help="http://host:port of sglang-router")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=30080, help="port to listen on")
    parser.add_argument(
        "--max-body-bytes",
        type=_positive(int),
        default=defaults.max_body_bytes,
        help="larger request bodies are answered 413",
    )
    parser.add_argument(
        "--allow-client-routing-key",
        action="store_true",
        help="keep a client's own X-SMG-Routing-Key (default: dropped, the gateway's key set)",
    )
    parser.add_argument(
        "--upstream-timeout-s",
        type=_positive(float),
        default=defaults.upstream_timeout_s,
        help="wait this long for the router's response head (504 after)",
    )
    parser.add_argument(
        "--max-connections",
        type=_positive(int),
        default=defaults.max_connections,
        help="client connections open at once; more are answered 503",
    )
    parser.add_argument(
        "--write-timeout-s",
        type=_positive(float),
        default=defaults.write_timeout_s,
        help="a client that takes no piece of a response for this long is dropped",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    return parser.parse_args(argv)


async def _serve(gateway: Gateway, host: str, port: int, router_url: str) -> None:
    server = await gateway.start(host, port)
    bound = server.sockets[0].getsockname()[1]
    rule = "kept" if gateway.config.allow_client_routing_key else "dropped"
    print(
        f"sgl_mmkv gateway: http://{host}:{bound} -> {router_url} (client routing keys {rule})",
        flush=True,
    )
    try:
        await server.serve_forever()
    finally:
        await gateway.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(message)s")
    try:
        router_host, router_port = parse_router_url(args.router_url)
        config = GatewayConfig(
            router_host,
            router_port,
            max_body_bytes=args.max_body_bytes,
            allow_client_routing_key=args.allow_client_routing_key,
            upstream_timeout_s=args.upstream_timeout_s,
            max_connections=args.max_connections,
            write_timeout_s=args.write_timeout_s,
        )
    except ValueError as e:
        print(f"sgl_mmkv.gateway: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(Gateway(config), args.host, args.port, args.router_url))
    except OSError as e:
        print(f"sgl_mmkv.gateway: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
