"""What each request pays between the socket and the engine thread: TCP_NODELAY on accepted sockets, and no per-token
event for a response that is not streamed."""

from __future__ import annotations

import asyncio
import socket

import httpx

from prefixcache import PrefixCachingRunner
from prefixcache.serve.server import bind
from prefixcache.testing import ScriptedModel


def test_connections_accepted_by_asyncio_on_the_bound_socket_have_nodelay() -> None:
    # Without TCP_NODELAY, Nagle holds a response's body behind its headers until the client's delayed ACK (~40 ms).
    async def main() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listening = bind("127.0.0.1", 0)
        server = await asyncio.start_server(on_connect, sock=listening)
        port = listening.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) != 0


def wake_ups(app, body: dict) -> tuple[int, list[str]]:
    """Cross-thread wake-ups of the event loop during one request through ``app``, and the SSE lines it got."""

    async def main() -> tuple[int, list[str]]:
        loop = asyncio.get_running_loop()
        count = 0
        original = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            nonlocal count
            count += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 200
                return count, [line for line in response.text.splitlines() if line.startswith("data: {")]
        finally:
            del loop.call_soon_threadsafe

    return asyncio.run(main())


def test_a_request_wakes_the_event_loop_per_step_only_when_it_streams(make_app) -> None:
    runner = PrefixCachingRunner(ScriptedModel.from_texts(["abcdefghijklmnopqrst"]), cache_tokens=4096)
    app = make_app(runner)
    body = {"model": "scripted", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20}
    plain, _ = wake_ups(app, body)
    assert plain == 2  # the request submitted (on the worker thread that tokenizes), and its end
    streamed, lines = wake_ups(app, {**body, "stream": True})
    # A stream wakes the loop once per engine step at most (serve.delivery's mailbox: the steps a busy loop has not
    # drained yet ride one wake-up, all of them on a loaded machine), and every token still reaches the client.
    assert plain <= streamed <= 20 + plain and len(lines) >= 20
