"""How events from the scheduler's threads reach the request handlers on the event loop: an
`Inbox` a handler, woken through one shared `Wakeups`."""

from __future__ import annotations

import asyncio
import collections


class Wakeups:
    """Wakes handlers on the event loop for events that other threads put in their inboxes: one
    `call_soon_threadsafe` for however many inboxes the threads fill meanwhile, so that a decode
    block's events for every running request cost the loop one wake-up, not one each (with many
    short streams the loop's own work is what a busy server waits on)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.due: collections.deque[Inbox] = collections.deque()
        self.scheduled = False

    def wake(self, inbox: Inbox):  # any thread
        self.due.append(inbox)
        if not self.scheduled:
            self.scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._run)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

    def _run(self):  # the event loop
        self.scheduled = False  # before draining: an inbox due after this schedules again
        while self.due:
            self.due.popleft().wake()


class Inbox:
    """Events from the scheduler's threads to one handler, in order."""

    def __init__(self, wakeups: Wakeups):
        self.wakeups = wakeups
        self.events: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None

    def put(self, event):  # the engine or output thread
        self.events.append(event)
        self.wakeups.wake(self)

    def wake(self):  # the event loop
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self, timeout: float):
        """The next event, or None after `timeout` seconds without one."""
        if not self.events:
            loop = self.wakeups.loop
            self.waiter = loop.create_future()
            timer = loop.call_later(max(timeout, 0), self.wake)
            try:
                await self.waiter
            finally:
                timer.cancel()
                self.waiter = None
        return self.events.popleft() if self.events else None
