"""Waiting-queue policies: which request is admitted next, and which is preempted.

FCFS admits in arrival order and preempts the newest running request; priority
admits the lowest `priority` value first (ties by arrival) and preempts the
running request with the highest value (ties: the latest arrival). A preempted
request goes back ahead of everything that ranks below it, so under FCFS it is
first.

The policy also orders the running list (`place_running`): the scheduler serves
running requests in that order and only preempts ones it has not served yet in
the step, so the policy's victim must sort last. Under FCFS admission order does
that; under priority the list is kept sorted by (priority, arrival).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator, Sequence

from services.engine.request import Request


class RequestQueue(ABC):
    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def add_preempted(self, request: Request) -> None: ...

    @abstractmethod
    def peek(self) -> Request: ...

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def requeue(self, requests: Sequence[Request]) -> None:
        """Put back requests popped this step (in the order popped) where they were."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    @abstractmethod
    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        """The running request to preempt among `candidates` (in running order)."""

    def place_running(self, running: list[Request], request: Request) -> None:
        """Insert a newly admitted request into the running list."""
        running.append(request)


class FcfsQueue(RequestQueue):
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def add_preempted(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def requeue(self, requests: Sequence[Request]) -> None:
        self._q.extendleft(reversed(requests))

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return candidates[-1]


def _rank(request: Request) -> tuple[int, float]:
    """Priority order: smaller ranks are served first and preempted last."""
    return (request.priority, request.arrival_time)


class PriorityQueue(RequestQueue):
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()
        self._removed: set[int] = set()

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._seq), request)
        )

    def add_preempted(self, request: Request) -> None:
        # Its original (priority, arrival) key already ranks it ahead of later arrivals.
        self.add(request)

    def _drop_removed(self) -> None:
        while self._heap and id(self._heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[3]))

    def peek(self) -> Request:
        self._drop_removed()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_removed()
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        # Lazy deletion keeps remove O(1); entries are skipped when they reach the top.
        self._removed.add(id(request))

    def requeue(self, requests: Sequence[Request]) -> None:
        # Each keeps its original (priority, arrival) key, hence its place.
        for request in requests:
            self.add(request)

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap) if id(e[3]) not in self._removed)

    def place_running(self, running: list[Request], request: Request) -> None:
        bisect.insort_right(running, request, key=_rank)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        # max() keeps the first of equals, so scan newest first to break ties by recency.
        return max(reversed(candidates), key=_rank)


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FcfsQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
