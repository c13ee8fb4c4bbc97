"""The request directory: who a request key is (``RequestInfo``: rid, tenant, times, how it
ended) for live requests and a bounded LRU of ended ones, and the retirement of live requests
that never ended. Separate from the page model: findings name requests long after their pages
are gone, and the directory's size is the memory budget's to set (sidecar/memory_budget.py).
"""

from __future__ import annotations

from collections import OrderedDict

from .request_info import RequestInfo

__all__ = ["RequestDirectory", "RequestInfo"]


class RequestDirectory:
    """rid / tenant by request key, for live and recently ended requests (bounded LRU)."""

    def __init__(self, max_ended: int = 100_000):
        self.max_ended = max_ended
        self._ended: OrderedDict[int, RequestInfo] = OrderedDict()
        self.live: dict[int, RequestInfo] = {}
        self._stub_seen_ns: dict[int, int] = {}  # first retire_idle scan that saw a live stub
        # live keys whose info is a stub (no REQ_BEGIN seen: not judged); the judge asks it of a
        # whole batch at once, and it is empty while every request's begin was seen
        self.stubs: set[int] = set()

    def begin(self, info: RequestInfo) -> None:
        self._ended.pop(info.key, None)
        self.live[info.key] = info
        if info.known:
            self.stubs.discard(info.key)
        else:
            self.stubs.add(info.key)

    def get(self, key: int) -> RequestInfo | None:
        return self.live.get(key) or self._ended.get(key)

    def get_or_stub(self, key: int) -> RequestInfo:
        info = self.get(key)
        if info is None:
            info = RequestInfo(key, rid=f"key:{key:016x}", tenant="", known=False)
            self.live[key] = info
            self.stubs.add(key)
        return info

    def retire_idle(self, now_ns: int, idle_ns: int, holds_kv) -> int:
        """Move to the ended LRU the live requests begun more than ``idle_ns`` ago that
        hold nothing (``holds_kv(key)`` false): requests the engine refused or aborted
        before they held KV never get a REQ_END (SGLang frees nothing for them, and
        REQ_END follows ``release_kv_cache``), and would otherwise stay live forever.
        They stay findable by key until the LRU drops them. Returns how many moved."""
        stale = []
        for key, info in self.live.items():
            # stubs (no REQ_BEGIN seen) have no begin time: their age counts from the first scan that saw them
            since = info.begin_ns or self._stub_seen_ns.setdefault(key, now_ns)
            if now_ns - since > idle_ns and not holds_kv(key):
                stale.append(key)
        for key in stale:
            self.end(key)
        return len(stale)

    @property
    def num_ended(self) -> int:
        return len(self._ended)

    def resize(self, max_ended: int) -> None:
        """A new capacity for ended requests (the memory budget's share); the oldest go first."""
        self.max_ended = max_ended
        while len(self._ended) > max_ended:
            self._ended.popitem(last=False)

    def end(self, key: int) -> RequestInfo | None:
        self._stub_seen_ns.pop(key, None)
        self.stubs.discard(key)
        info = self.live.pop(key, None)
        if info is not None:
            self._ended[key] = info
            while len(self._ended) > self.max_ended:
                self._ended.popitem(last=False)
        return info
