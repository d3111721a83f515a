"""The mailbox that carries a stream's events from the engine thread to the event loop."""

from __future__ import annotations

import asyncio
import threading

from prefixcache.serve.delivery import Mailbox


class _CountingLoop:
    """An event loop's ``call_soon_threadsafe``, counted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.wakeups = loop, 0

    def call_soon_threadsafe(self, callback, *args):
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(callback, *args)


def test_the_posts_of_one_batch_wake_the_loop_once_and_arrive_in_order() -> None:
    loop = asyncio.new_event_loop()
    try:
        counting = _CountingLoop(loop)
        mailbox = Mailbox(counting)  # type: ignore[arg-type]
        first, second = asyncio.Queue(), asyncio.Queue()
        for i in range(5):
            mailbox.post(first, i)
            mailbox.post(second, -i)
        assert counting.wakeups == 1
        loop.run_until_complete(asyncio.sleep(0))
        assert [first.get_nowait() for _ in range(5)] == [0, 1, 2, 3, 4]
        assert [second.get_nowait() for _ in range(5)] == [0, -1, -2, -3, -4]
        mailbox.post(first, "next")
        assert counting.wakeups == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert first.get_nowait() == "next"
    finally:
        loop.close()


def test_posts_from_two_threads_racing_the_loop_are_all_delivered_in_each_thread_s_order() -> None:
    async def run() -> list[list[tuple[int, int]]]:
        mailbox = Mailbox(asyncio.get_running_loop())
        queue: asyncio.Queue = asyncio.Queue()

        def poster(thread: int) -> None:
            for i in range(2000):
                mailbox.post(queue, (thread, i))

        threads = [threading.Thread(target=poster, args=(t,)) for t in range(2)]
        for thread in threads:
            thread.start()
        got = [await queue.get() for _ in range(4000)]
        for thread in threads:
            thread.join()
        return [[event for event in got if event[0] == t] for t in range(2)]

    per_thread = asyncio.run(run())
    assert per_thread == [[(t, i) for i in range(2000)] for t in range(2)]


def test_a_post_after_the_loop_closed_is_dropped() -> None:
    loop = asyncio.new_event_loop()
    loop.close()
    mailbox = Mailbox(loop)
    mailbox.post(asyncio.Queue(), "late")  # no error: nobody is listening
