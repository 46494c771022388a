"""The Mooncake store of the tests (harness/mooncake_cluster.py), skipping the calling
test where Mooncake's client does not import, and what the tests do to the store."""

from __future__ import annotations

import time

import pytest

from harness import mooncake_cluster
from harness.mooncake_cluster import BIND_ENV, LOOPBACK, free_port

__all__ = [
    "BIND_ENV",
    "LOOPBACK",
    "MooncakeCluster",
    "client_class",
    "empty_fill",
    "fill_store",
    "free_port",
]


def client_class():
    """``MooncakeDistributedStore``, or skip with what to install."""
    try:
        return mooncake_cluster.client_class()
    except ImportError as error:
        pytest.skip(f"Mooncake not installed here: {error}")


class MooncakeCluster(mooncake_cluster.MooncakeCluster):
    """The harness's cluster; skips the test before starting anything without Mooncake."""

    def __init__(self, *args, **kwargs) -> None:
        client_class()
        super().__init__(*args, **kwargs)


def overwrite(client, name: str, data: bytes) -> None:
    """Replace object ``name`` with ``data`` (Mooncake keeps the first put of a name)."""
    client.remove(name, True)
    assert client.put(name, data) == 0


def fill_store(client, sizes=(4 << 20, 1 << 20, 256 << 10, 64 << 10, 16 << 10, 4 << 10)) -> int:
    """Fill every segment with hard-pinned objects (Mooncake never evicts them) until
    no object of the smallest size fits, also after the master's eviction of unpinned
    objects had time to free room. Returns the objects written (``fill_*``)."""
    from mooncake.store import ReplicateConfig

    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    count = 0
    for _ in range(10):
        added = 0
        for size in sizes:
            while client.put(f"fill_{count}", bytes(size), pinned) == 0:
                count += 1
                added += 1
        if count and not added:
            return count
        time.sleep(1.0)  # eviction runs in the background above its high watermark
    return count


def empty_fill(client) -> None:
    client.remove_by_regex("^fill_", True)
