"""Real SGLang HTTP servers on CPU, as subprocesses, for the demo and the tests.

Each engine is ``python -m sglang.launch_server`` with a tiny dummy-weight GPT-2
(:mod:`sidecar.demo.model`) or, with ``load_format="auto"``, a model with real weights
such as the echo GPT-2 (:mod:`sidecar.demo.echo_model`), for one SGLang version installed under
``.venv/sglang/<version>`` (``make venv``) and chosen by ``PYTHONPATH``, and one
role: ``"prefill"``, ``"decode"`` or ``None`` (a plain engine).

A prefill/decode pair (:class:`PDPair`) moves real KV bytes over Mooncake/TCP. By
default SGLang's own router (``sglang-router``, :class:`Router`) runs in front of it
and requests go to the router as a client sends them: no ``rid``, no bootstrap
fields. The router picks a ``bootstrap_room``, adds ``bootstrap_host/port/room`` to
the body and posts it to both engines, and each engine draws its own rid (prefill's
and decode's differ). The client learns decode's rid (``meta_info["id"]``), never
the room. ``router=False`` keeps the direct path: the same body, with an explicit
rid and room, posted to both engines by this process.

    with PDPair("0.5.19", ring_dir, log_dir) as pair:
        r = pair.generate([5, 6, 7] * 70, tenant="acme", max_new_tokens=8)

Every engine and the router run in their own session (process group); :meth:`Engine.stop`
sends SIGTERM to the group, then SIGKILL, and waits until no process of it is left.

The harness lives in modules of its own, all re-exported here (import from this module):
:mod:`~kvguard.demo.engine_env` (versions, folders, ports, the subprocess environment and
arguments), :mod:`~kvguard.demo.engine_process` (:func:`start_engine`, :class:`Engine`),
:mod:`~kvguard.demo.router` (:func:`start_router`, :class:`Router`),
:mod:`~kvguard.demo.engine_requests` (:class:`GenerateResult`, posting helpers) and
:mod:`~kvguard.demo.pd_pair` (:class:`PDPair`).
"""

from __future__ import annotations

import logging

from kvguard.demo.engine_env import (
    DEFAULT_CONTEXT_LENGTH,
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_WAITING_TIMEOUT_S,
    ENGINE_TENANT_FIELDS,
    FIXED_VERSION,
    LEAKING_VERSION,
    LOG_TAIL_LINES,
    ROLES,
    ROUTED_TENANT_FIELDS,
    SGLANG_VERSIONS,
    TENANT_FIELD,
    default_model_dir,
    engine_args,
    engine_env,
    free_port,
    repo_root,
    sglang_dir,
    shim_dir,
    tenant_payload,
)
from kvguard.demo.engine_process import _SGLANG_SHM_PREFIXES as _SGLANG_SHM_PREFIXES
from kvguard.demo.engine_process import Engine, EngineStartError, start_engine
from kvguard.demo.engine_process import _group_members as _group_members
from kvguard.demo.engine_process import _shm_files as _shm_files
from kvguard.demo.engine_process import _tail as _tail
from kvguard.demo.engine_process import _terminate_group as _terminate_group
from kvguard.demo.engine_requests import _ERROR_RID as _ERROR_RID
from kvguard.demo.engine_requests import _ERROR_ROOM as _ERROR_ROOM
from kvguard.demo.engine_requests import GenerateResult, ids_from_error
from kvguard.demo.engine_requests import _error_text as _error_text
from kvguard.demo.engine_requests import _post as _post
from kvguard.demo.engine_requests import _post_stream as _post_stream
from kvguard.demo.engine_requests import _Reply as _Reply
from kvguard.demo.engine_requests import _result as _result
from kvguard.demo.pd_pair import PDPair
from kvguard.demo.router import (
    DEFAULT_ROUTER_STARTUP_TIMEOUT_S,
    ROUTER_SMOKE_BODY,
    Router,
    router_args,
    router_available,
    start_router,
)

logger = logging.getLogger(__name__)  # the harness's logger; the modules above log under this name

__all__ = [
    "DEFAULT_CONTEXT_LENGTH",
    "DEFAULT_ROUTER_STARTUP_TIMEOUT_S",
    "DEFAULT_STARTUP_TIMEOUT_S",
    "DEFAULT_WAITING_TIMEOUT_S",
    "ENGINE_TENANT_FIELDS",
    "FIXED_VERSION",
    "LEAKING_VERSION",
    "LOG_TAIL_LINES",
    "ROLES",
    "ROUTED_TENANT_FIELDS",
    "ROUTER_SMOKE_BODY",
    "SGLANG_VERSIONS",
    "TENANT_FIELD",
    "Engine",
    "EngineStartError",
    "GenerateResult",
    "PDPair",
    "Router",
    "default_model_dir",
    "engine_args",
    "engine_env",
    "free_port",
    "ids_from_error",
    "logger",
    "repo_root",
    "router_args",
    "router_available",
    "sglang_dir",
    "shim_dir",
    "start_engine",
    "start_router",
    "tenant_payload",
]
