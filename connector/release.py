"""Tell a prefiller to free a request's held blocks now (no decoder will come for them).

For a router that cancels a request between its prefill and decode legs: instead of the
blocks waiting out the expiry, it sends the release that a decoder would send, using the
``kv_transfer_params`` the prefiller returned (host, port, transfer id and secret).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import zmq
import zmq.asyncio

from connector.wire import PROTOCOL_VERSION, PullItem, PullRequest, WireError, decode_reply, encode

_ids = itertools.count(1)


async def release_remote(
    kv_transfer_params: dict[str, Any],
    timeout_s: float = 5.0,
    ctx: zmq.asyncio.Context | None = None,
    tp_rank: int = 0,
) -> str | None:
    """Release one held request; None on success, else why it failed (never raises)."""
    try:
        host = kv_transfer_params["remote_host"]
        port = int(kv_transfer_params["remote_port"]) + tp_rank
        item = PullItem(
            str(kv_transfer_params["transfer_id"]), str(kv_transfer_params["transfer_secret"]), []
        )
    except (KeyError, TypeError, ValueError) as exc:
        return f"incomplete kv_transfer_params: {exc!r}"
    msg = PullRequest(
        version=PROTOCOL_VERSION,
        msg_id=next(_ids),
        decoder_engine_id="release",
        decoder_session="",
        groups=[],
        deadline_ms=int((time.time() + timeout_s) * 1000),
        items=[item],
    )
    ctx = ctx or zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    try:
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}")
        async with asyncio.timeout(timeout_s):
            await sock.send(encode(msg))
            reply = decode_reply(await sock.recv())
    except TimeoutError:
        return f"no answer from {host}:{port} within {timeout_s:g}s"
    except (zmq.ZMQError, WireError) as exc:
        return f"release to {host}:{port} failed: {exc}"
    finally:
        sock.close(linger=0)
    return None if reply.ok else reply.error


async def release_all_ranks(
    kv_transfer_params: dict[str, Any],
    timeout_s: float = 5.0,
    ctx: zmq.asyncio.Context | None = None,
) -> list[str]:
    """Release a request on every TP rank of the prefiller that holds it, concurrently.

    Each rank holds its own share of the blocks and serves its own side-channel port
    (base + tp_rank); ``remote_tp_size`` in the params says how many there are. Returns
    one error per rank that failed (empty: all released).
    """
    size = (
        kv_transfer_params.get("remote_tp_size", 1) if isinstance(kv_transfer_params, dict) else 1
    )
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 1024:
        return [f"bad remote_tp_size {size!r}"]
    results = await asyncio.gather(
        *(release_remote(kv_transfer_params, timeout_s, ctx, rank) for rank in range(size))
    )
    return [f"rank {rank}: {err}" for rank, err in enumerate(results) if err is not None]
