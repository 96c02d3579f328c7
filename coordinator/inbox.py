"""The coordinator loop's inbox: the one typed queue through which every other thread reaches the loop.

Any thread posts events (`post`), or asks and waits for the actions an event led to (`ask`); only the
loop takes them, in batches (`take`). `close` puts a stop mark after what is already queued.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future
from dataclasses import dataclass

from pscluster.coordinator.events import Action, Event
from pscluster.proto import pscluster_pb2 as pb


@dataclass(frozen=True)
class Posted:
    """One event for the loop, with what comes along with it."""

    event: Event
    reply: pb.RunClosureReply | None = None  # a closure's answer, for the Finished event it caused
    answer: Future[list[Action]] | None = None  # set to the event's actions (or the error it met)


class Inbox:
    """Events for the coordinator loop, in arrival order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Posted | None] = queue.SimpleQueue()  # None: the stop mark

    def post(self, event: Event, reply: pb.RunClosureReply | None = None) -> None:
        """Hand the loop an event (and the closure answer a Finished event carries)."""
        self._queue.put(Posted(event, reply))

    def ask(self, event: Event) -> Future[list[Action]]:
        """Hand the loop an event; the future gets the actions it led to, after the loop published them."""
        answer: Future[list[Action]] = Future()
        self._queue.put(Posted(event, answer=answer))
        return answer

    def close(self) -> None:
        """Stop the loop once it reaches this point of the queue."""
        self._queue.put(None)

    def take(self, limit: int) -> list[Posted | None]:
        """Wait for one entry, then take what else is queued, up to limit entries (None: stop here)."""
        batch = [self._queue.get()]
        while len(batch) < limit:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch
