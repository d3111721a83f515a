"""What each request pays between the socket and the model thread: TCP_NODELAY on accepted sockets, and no per-token
event for a response that is not streamed."""

from __future__ import annotations

import asyncio
import socket
import threading

from prefixcache.serve.server import bind
from prefixcache.serve.worker import ModelWorker


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


def steps(n: int):
    yield from range(n)
    return "finished"


def run_job(deltas: bool) -> list[tuple[str, object]]:
    worker = ModelWorker(name="test-model")
    events: list[tuple[str, object]] = []
    done = threading.Event()

    def sink(kind: str, value: object) -> None:
        events.append((kind, value))
        if kind != "delta":
            done.set()

    worker.submit(lambda: steps(4), sink, deltas=deltas)
    assert done.wait(10)
    worker.close()
    return events


def test_a_job_reports_each_step_only_when_it_streams() -> None:
    assert run_job(deltas=True) == [("delta", 0), ("delta", 1), ("delta", 2), ("delta", 3), ("done", "finished")]
    assert run_job(deltas=False) == [("done", "finished")]
