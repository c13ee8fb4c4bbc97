"""The prefill/decode pair (:class:`PDPair`): two engines of one SGLang version, Mooncake
over TCP, SGLang's router in front by default, and :meth:`PDPair.generate`, which sends
a request as a client would. Re-exported by :mod:`kvguard.demo.engines`.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvguard.demo.engine_env import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_WAITING_TIMEOUT_S,
    default_model_dir,
    free_port,
    sglang_dir,
    tenant_payload,
)
from kvguard.demo.engine_process import Engine, start_engine
from kvguard.demo.engine_requests import GenerateResult, _post, _post_stream, _result, ids_from_error
from kvguard.demo.router import Router, router_available, start_router

logger = logging.getLogger("kvguard.demo.engines")  # the harness's logger name, as before the split

# ---------------------------------------------------------------- prefill/decode pair


class PDPair:
    """A prefill engine and a decode engine of one SGLang version, Mooncake over TCP,
    with SGLang's router in front (``router=False``: none; requests go to both engines).

    Prefill starts first: its tokenizer manager hosts the bootstrap server that
    decode registers with; the router starts once both serve. All are stopped on
    exit: the router, then decode and prefill.

    ``router_args``: extra ``launch_router`` arguments (e.g. ``["--disable-retries"]``).
    ``progress``: called with one line per start-up step (the demo prints them).
    """

    def __init__(
        self,
        version: str,
        ring_dir: str | os.PathLike | None,
        log_dir: str | os.PathLike,
        prefill_pool_tokens: int = 256,
        decode_pool_tokens: int = 1024,
        *,
        model_dir: str | os.PathLike | None = None,
        context_length: int = DEFAULT_CONTEXT_LENGTH,
        waiting_timeout_s: int = DEFAULT_WAITING_TIMEOUT_S,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        extra_pythonpath: Iterable[str | os.PathLike] = (),
        load_format: str = "dummy",
        router: bool = True,
        router_args: Sequence[str] = (),
        progress: Callable[[str], None] | None = None,
    ) -> None:
        sglang_dir(version)  # fail early with the `make venv` hint
        if router and (missing := router_available()):
            raise FileNotFoundError(missing)
        self.version = version
        self.ring_dir = ring_dir
        self.log_dir = Path(log_dir)
        self.prefill_pool_tokens = prefill_pool_tokens
        self.decode_pool_tokens = decode_pool_tokens
        self.model_dir = model_dir
        self.context_length = context_length
        self.waiting_timeout_s = waiting_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.prefill_args = list(prefill_args)
        self.decode_args = list(decode_args)
        self.extra_env = dict(extra_env or {})
        self.extra_pythonpath = list(extra_pythonpath)
        self.load_format = load_format
        self.use_router = router
        self.router_args = list(router_args)
        self.progress = progress
        self.bootstrap_port: int | None = None
        self.prefill: Engine | None = None
        self.decode: Engine | None = None
        self.router: Router | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        """Where a client sends requests: the router (``router=False``: decode, which
        alone answers nothing without prefill; use :meth:`generate`)."""
        if self.router is not None:
            return self.router.url
        if self.decode is None:
            raise RuntimeError("PDPair is not started")
        return self.decode.url

    def _say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)

    # -- lifecycle

    def _start(self, role: str, pool_tokens: int, args: Sequence[str], wait: bool) -> Engine:
        return start_engine(
            self.version,
            self.log_dir,
            role=role,
            model_dir=self.model_dir,
            max_total_tokens=pool_tokens,
            context_length=self.context_length,
            bootstrap_port=self.bootstrap_port,
            ring_dir=self.ring_dir,
            waiting_timeout_s=self.waiting_timeout_s,
            load_format=self.load_format,
            extra_args=args,
            extra_env=self.extra_env,
            extra_pythonpath=self.extra_pythonpath,
            startup_timeout_s=self.startup_timeout_s,
            wait=wait,
        )

    def start(self) -> PDPair:
        """Start prefill; start decode once prefill's bootstrap server listens; wait for
        both; then start the router in front of them and wait until it forwards.

        NOTE: overlapping the two start-ups saves ~15 s on 2 cores. Decode needs
        the bootstrap server only when the first request arrives (its warmup uses
        SGLang's fake bootstrap host), but it is up long before then anyway.
        """
        t0 = time.monotonic()
        self.model_dir = self.model_dir or default_model_dir(self.context_length)
        self.bootstrap_port = free_port()
        try:
            self._say(f"starting the prefill engine (SGLang {self.version}, KV pool {self.prefill_pool_tokens} tokens)")
            self.prefill = self._start("prefill", self.prefill_pool_tokens, self.prefill_args, wait=False)
            self._wait_bootstrap_server(t0)
            self._say(f"starting the decode engine (KV pool {self.decode_pool_tokens} tokens)")
            self.decode = self._start("decode", self.decode_pool_tokens, self.decode_args, wait=False)
            self.prefill.wait_ready(max(0.0, t0 + self.startup_timeout_s - time.monotonic()))
            self._say(f"prefill engine ready in {self.prefill.startup_s:.0f} s")
            self.decode.wait_ready(max(0.0, t0 + self.startup_timeout_s - time.monotonic()))
            self._say(f"decode engine ready in {self.decode.startup_s:.0f} s")
            if self.use_router:
                self._say("starting SGLang's router in front of them")
                self.router = start_router(self.prefill, self.decode, self.log_dir, extra_args=self.router_args)
                self._say(f"router ready in {self.router.startup_s:.0f} s: it forwards requests to both engines")
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        logger.info(
            "SGLang %s prefill/decode pair ready in %.1f s (prefill %.1f s, decode %.1f s%s)",
            self.version,
            self.startup_s,
            self.prefill.startup_s,
            self.decode.startup_s,
            f", router {self.router.startup_s:.1f} s" if self.router else "",
        )
        return self

    def _wait_bootstrap_server(self, t0: float) -> None:
        assert self.prefill is not None and self.bootstrap_port is not None
        deadline = t0 + self.startup_timeout_s
        while time.monotonic() < deadline:
            if not self.prefill.is_running():
                self.prefill.wait_ready(0)  # raises with the log tail
            try:
                with socket.create_connection(("127.0.0.1", self.bootstrap_port), timeout=1.0):
                    return
            except OSError:
                time.sleep(0.3)
        self.prefill.wait_ready(0)  # raises with the log tail unless ready

    def stop(self) -> None:
        """Stop the router, then both engines (in parallel); idempotent."""
        if self.router is not None:
            self.router.stop()
        engines = [e for e in (self.decode, self.prefill) if e is not None]
        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(Engine.stop, engines))

    def __enter__(self) -> PDPair:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        tenant: str | None = None,
        max_new_tokens: int = 8,
        room: int | None = None,
        rid: str | None = None,
        stream: bool = False,
        sampling_params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        disconnect_after_chunks: int | None = None,
    ) -> GenerateResult:
        """Send one request, as a client: to the router, or (``router=False``) to both
        engines concurrently, the router's way.

        ``prompt``: text, or token ids (ints in 3..255 with the tiny model: exact
        lengths). ``stream`` streams decode's answer (TTFT); ``disconnect_after_chunks``
        (with ``stream``) closes the connection after that many chunks, a client going
        away mid-stream. Through the router ``rid`` is left out unless given (each engine
        then draws its own) and ``room`` cannot be chosen (the router draws it). The
        default HTTP timeout outlasts decode's waiting timeout, so a request whose KV
        never arrives returns decode's own error rather than a client timeout.
        """
        if self.prefill is None or self.decode is None:
            raise RuntimeError("PDPair is not started")
        if disconnect_after_chunks is not None and not stream:
            raise ValueError("disconnect_after_chunks needs stream=True")
        timeout_s = timeout_s or self.waiting_timeout_s + 120.0
        body: dict[str, Any] = {
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, **(sampling_params or {})},
        }
        if isinstance(prompt, str):
            body["text"] = prompt
            prompt_len = -1  # unknown without the tokenizer
        else:
            body["input_ids"] = [int(t) for t in prompt]
            prompt_len = len(body["input_ids"])
        if self.router is not None:
            if room is not None:
                raise ValueError("the router draws bootstrap_room itself: use PDPair(router=False) to choose it")
            return self._generate_routed(body, rid, tenant, prompt_len, stream, timeout_s, disconnect_after_chunks)
        room = random.randrange(1, 2**63) if room is None else room
        rid = rid or f"kvg-{uuid.uuid4().hex[:16]}"
        body.update(
            {
                "rid": rid,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": room,
                **tenant_payload(tenant),
            }
        )
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=2) as pool:
            fp = pool.submit(_post, self.prefill.url + "/generate", body, timeout_s, t0)
            d_body = {**body, "stream": stream}
            if stream:
                fd = pool.submit(
                    _post_stream, self.decode.url + "/generate", d_body, timeout_s, t0, disconnect_after_chunks
                )
            else:
                fd = pool.submit(_post, self.decode.url + "/generate", d_body, timeout_s, t0)
            p, d = fp.result(), fd.result()
        result = _result(d, rid, room, tenant, prompt_len)
        result.prefill_status, result.prefill_error, result.prefill_latency_s = p.status, p.error, p.latency_s
        return result

    def _generate_routed(
        self,
        body: dict[str, Any],
        rid: str | None,
        tenant: str | None,
        prompt_len: int,
        stream: bool,
        timeout_s: float,
        disconnect_after_chunks: int | None,
    ) -> GenerateResult:
        assert self.router is not None
        body = {**body, **tenant_payload(tenant, routed=True), "stream": stream}
        if rid is not None:
            body["rid"] = rid  # the router forwards it: both engines then use it
        t0 = time.monotonic()
        url = self.router.url + "/generate"
        reply = (
            _post_stream(url, body, timeout_s, t0, disconnect_after_chunks)
            if stream
            else _post(url, body, timeout_s, t0)
        )
        result = _result(reply, rid, None, tenant, prompt_len)
        result.routed = True
        result.prefill_status = None
        # decode's rid: the answer's meta_info id, else what decode's error names
        err_rid, err_room = ids_from_error(reply.error)
        result.rid = result.meta_info.get("id") or err_rid or rid
        result.room = err_room
        return result
