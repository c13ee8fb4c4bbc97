"""Non-blocking delivery: a bounded queue drained by one worker thread per sink.

The ingest thread calls ``send``/``resolve``; they only enqueue (never block, never
raise). A full queue drops the item and counts it. The worker retries what the
transport says is retryable, with exponential backoff and a deadline, and gives up
on the rest at once (counted, logged with the reason). Mirrors OpenTelemetry's
BatchSpanProcessor: the exporter may be slow, the caller must not be.

Every item ends in exactly one result, counted per (action, result) for
``kvguard_sink_events_total`` (docs/metrics.md): ``delivered``; ``rejected`` (a
permanent error: the receiver refused it, retrying cannot help); ``gave_up`` (still
failing when the retry deadline passed); ``dropped`` (the queue was full). Retries,
the queue depth and the time of the last delivery are exported too.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

from ..stats import SinkStats

ACTIONS = ("trigger", "resolve")
RESULTS = ("delivered", "rejected", "gave_up", "dropped")

log = logging.getLogger("kvguard.sinks")


class RetryableError(Exception):
    """Delivery failed in a way that may succeed later (429, 5xx, timeouts, refused connections)."""


class PermanentError(Exception):
    """Delivery failed and retrying cannot help (400, bad credentials, payload too large)."""


@dataclass(frozen=True)
class RetryPolicy:
    initial_s: float = 0.5
    max_s: float = 30.0
    deadline_s: float = 120.0

    def delays(self):
        delay, waited = self.initial_s, 0.0
        while waited < self.deadline_s:
            jittered = delay * (0.5 + random.random() / 2)
            yield jittered
            waited += jittered
            delay = min(delay * 2, self.max_s)


class QueuedSink:
    """Wraps a transport (``deliver(kind, item)`` raising Retryable/PermanentError)."""

    def __init__(self, transport, name: str, max_queue: int = 1000, retry: RetryPolicy | None = None):
        self.transport, self.name = transport, name
        self.retry = retry or RetryPolicy()
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.counts: Counter = Counter()  # delivered, dropped_queue_full, failed_permanent, failed_retries, retries
        # (action, result) -> items; every pair present from the start, so the counters export 0
        self.results: Counter = Counter({(a, r): 0 for a in ACTIONS for r in RESULTS})
        self.last_success_s = 0.0  # wall-clock time of the last delivery; 0 before the first
        self.max_queue = max_queue
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvguard-sink-{name}", daemon=True)
        self._thread.start()

    # called on the ingest thread: never block, never raise
    def send(self, finding) -> None:
        self._offer(("trigger", finding))

    def resolve(self, incident) -> None:
        self._offer(("resolve", incident))

    def _offer(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.counts["dropped_queue_full"] += 1
            self.results[(item[0], "dropped")] += 1
            log.error("%s: delivery queue full, dropped a %s", self.name, item[0])

    def _run(self) -> None:
        while not self._stop.is_set() or not self._queue.empty():
            try:
                action, item = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self._deliver(action, item)
            finally:
                self._queue.task_done()

    def _deliver(self, action: str, item) -> None:
        delays = self.retry.delays()
        while True:
            try:
                self.transport.deliver(action, item)
                self.counts["delivered"] += 1
                self.results[(action, "delivered")] += 1
                self.last_success_s = time.time()
                return
            except PermanentError as exc:
                self.counts["failed_permanent"] += 1
                self.results[(action, "rejected")] += 1
                log.error("%s: %s not delivered, not retrying: %s", self.name, action, exc)
                return
            except RetryableError as exc:
                delay = next(delays, None)
                if delay is None or self._stop.is_set() and self._queue.qsize() > 0:
                    self.counts["failed_retries"] += 1
                    self.results[(action, "gave_up")] += 1
                    log.error("%s: %s not delivered after retries: %s", self.name, action, exc)
                    return
                self.counts["retries"] += 1
                log.warning("%s: %s delivery failed (%s); retrying in %.1f s", self.name, action, exc, delay)
                time.sleep(delay)

    def queue_depth(self) -> int:
        """Items waiting, plus the one being delivered (retries included)."""
        return self._queue.unfinished_tasks

    def delivery_stats(self) -> SinkStats:
        """This sink's delivery figures (sidecar/stats.py), read on the caller's thread while
        the worker may count: ``results`` has every (action, result) key from the start, so
        copying it never meets a key being added."""
        return SinkStats(
            name=self.name,
            events=dict(self.results),
            retries=self.counts["retries"],
            queue_depth=self.queue_depth(),
            queue_capacity=self.max_queue,
            last_success_s=self.last_success_s,
        )

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self.force_flush(timeout_s)
        self._stop.set()
        self._thread.join(timeout=timeout_s)
