"""``kvguard preflight`` behind SGLang's router: list the router's workers, check each one.

SGLang's router (``sglang-router`` on PyPI, the Rust "SGLang Model Gateway", ``smg``)
is no SGLang server: it holds no KV pool and has no context length of its own. What
it does have is a list of the workers it routes to. Verified on sglang-router 0.3.2
in front of SGLang 0.5.23 servers, in prefill/decode mode (``--pd-disaggregation
--prefill URL BOOTSTRAP_PORT --decode URL``) and regular mode (``--worker-urls``):

- ``GET /server_info`` answers 404 with an empty body (the router's own summary is
  ``GET /get_server_info``: ``{"router_manager": true, "routers_count": 1,
  "workers_count": 2}``, served as text/plain; ``/v1/models`` lists the model without
  ``max_model_len``). ``/list_workers`` does not exist (404).
- ``GET /workers`` lists the registered workers::

      {"workers": [{"id": "<uuid>", "url": "http://10.0.0.1:30000", "model_id": "...",
                    "worker_type": "prefill", "is_healthy": true, "connection_mode": "HTTP",
                    "bootstrap_port": 8998, "metadata": {"disaggregation_mode": "prefill", ...},
                    ...}, ...],
       "total": 2, "stats": {"prefill_count": 1, "decode_count": 1, "regular_count": 0}}

  ``worker_type`` is ``prefill``, ``decode`` or ``regular``. With ``--api-key`` on the
  router, ``/workers`` wants ``Authorization: Bearer <key>`` (401 with an empty body
  otherwise); per the router's README, workers given on its command line share that
  key, so preflight sends the same token to them.
- A worker that could not be registered (down when the router started, or still
  starting) is **absent** from the list: nothing lists the workers the router was
  told about but has not registered. Registration runs in the background after the
  router starts listening (``Router ready | workers: []``), so a list read in the
  first seconds can be short.
- The router's health flag lags: a worker killed after registration stays
  ``is_healthy: true`` until the next health check (60 s by default). Preflight
  therefore reads every worker itself and trusts nothing the router says about it
  beyond its URL and type.
- With ``--dp-aware`` each DP rank is registered as its own worker, ``BASE_URL@RANK``
  (from the router's source, create_dp_aware_workers; not run on CPU); the ranks
  share one HTTP server, which is checked once.

This module parses the router's list and checks each worker with
:func:`kvguard.sidecar.preflight.checks.check`, as any server is checked (imported at call time:
:mod:`.checks` imports this module).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from .checks import Report

WORKERS_PATH = "/workers"

# the router's worker_type -> the role preflight reports when the worker itself cannot be read
ROLE_OF_WORKER_TYPE = {"prefill": "prefill", "decode": "decode"}

_DP_RANK = re.compile(r"^(.*)@(\d+)$")


@dataclass
class RouterWorker:
    """One server behind the router, as the router lists it (DP ranks folded into one)."""

    url: str  # as listed, less any ``@RANK`` suffix
    worker_type: str | None  # "prefill", "decode", "regular", or None when not given
    connection_mode: str | None = None  # "HTTP" or "gRPC" (0.3.2 writes "HTTP")
    healthy: bool | None = None
    dp_ranks: list[int] = field(default_factory=list)

    @property
    def http(self) -> bool:
        mode = (self.connection_mode or "http").lower()
        return mode == "http" and not self.url.lower().startswith("grpc://")


@dataclass
class RouterListing:
    workers: list[RouterWorker]
    counts: dict[str, int]  # workers per type: prefill, decode, regular


def is_router_listing(body: Any) -> bool:
    """Whether a ``GET /workers`` answer is the router's worker list (an object with a list ``workers``)."""
    return isinstance(body, dict) and isinstance(body.get("workers"), list)


def parse_workers(body: Any) -> RouterListing:
    """The router's workers from its ``GET /workers`` answer; ValueError (one line) when malformed.

    DP-aware entries ``URL@RANK`` of one server become one worker.
    """
    if not is_router_listing(body):
        raise ValueError(f"GET {WORKERS_PATH} did not return an object with a 'workers' list")
    by_url: dict[str, RouterWorker] = {}
    for i, entry in enumerate(body["workers"]):
        if not isinstance(entry, dict):
            raise ValueError(f"GET {WORKERS_PATH}: entry {i} is {type(entry).__name__}, not an object")
        url = entry.get("url")
        if not isinstance(url, str) or not url.strip():
            raise ValueError(f"GET {WORKERS_PATH}: entry {i} has no 'url'")
        url = url.strip()
        rank = None
        m = _DP_RANK.match(url)
        if m:
            url, rank = m.group(1), int(m.group(2))
        wtype = entry.get("worker_type")
        wtype = wtype.lower() if isinstance(wtype, str) and wtype else None
        mode = entry.get("connection_mode")
        healthy = entry.get("is_healthy")
        w = by_url.get(url)
        if w is None:
            w = by_url[url] = RouterWorker(
                url, wtype, mode if isinstance(mode, str) else None, healthy if isinstance(healthy, bool) else None
            )
        elif healthy is False:
            w.healthy = False
        if rank is not None:
            w.dp_ranks.append(rank)
    workers = list(by_url.values())
    counted = {t: sum(w.worker_type == t for w in workers) for t in ("prefill", "decode", "regular")}
    return RouterListing(workers, counted)


def missing_role(listing: RouterListing) -> str | None:
    """Why a prefill/decode router's list is incomplete (prefill without decode or the reverse), or None."""
    p, d = listing.counts["prefill"], listing.counts["decode"]
    if p and not d:
        have, lacking = f"{p} prefill worker{'s' if p != 1 else ''}", "decode"
    elif d and not p:
        have, lacking = f"{d} decode worker{'s' if d != 1 else ''}", "prefill"
    else:
        return None
    return (
        f"the router lists {have} and no {lacking} worker: the {lacking} servers of this prefill/decode "
        f"deployment are not registered (still starting, or unreachable when the router registered them), "
        f"so they cannot be checked"
    )


NO_WORKERS = (
    "the router lists no workers (GET /workers is empty): nothing to check. The router registers its "
    "workers in the background after it starts listening; run preflight once they are up, or against "
    "each server's own URL"
)


def type_note(worker_type: str | None, role: str | None) -> str | None:
    """A note when the router's type for a worker disagrees with the role the server reports."""
    if worker_type is None or role is None:
        return None
    if worker_type in ("prefill", "decode") and role != worker_type:
        return f"the router lists this server as a {worker_type} worker but the server reports role {role!r}"
    if worker_type == "regular" and role in ("prefill", "decode"):
        return (
            f"the router sends whole requests to this server (a regular worker) but it is a {role} server "
            f"of a prefill/decode deployment"
        )
    return None


def grpc_reason(worker: RouterWorker) -> str:
    return (
        f"gRPC worker (the router reaches it over {worker.connection_mode or 'grpc://'}): preflight reads "
        f"SGLang's HTTP /server_info; run it against this server's HTTP port"
    )


ROUTER_ROLE = "router"  # the role of a report about the router itself (its list), not a server


def health_note(worker: RouterWorker) -> str | None:
    if worker.healthy is False:
        return "the router marks this worker unhealthy (is_healthy false)"
    return None


def dp_note(worker: RouterWorker) -> str | None:
    if len(worker.dp_ranks) > 1:
        return (
            f"the router lists it once per DP rank ({len(worker.dp_ranks)} ranks, {worker.url}@RANK); "
            f"they share this server, checked once"
        )
    return None


# ---------------------------------------------------------------- checking the workers

_TYPE_ORDER = {"prefill": 0, "decode": 1, "regular": 2}
_MAX_WORKERS = 8


def check_workers(
    shown: str, body: Any, *, timeout_s: float, token: str | None, transport: httpx.BaseTransport | None = None
) -> list[Report]:
    """One report per worker the router at ``shown`` lists in ``body``, each read directly.

    Prefill workers first, then decode, then regular. Each worker gets its own
    ``timeout_s`` and the same bearer token. A report with role ``router`` is added when
    the list is empty or malformed, or names prefill workers and no decode worker (or
    the reverse). Never raises.
    """
    from . import checks as pf  # checks imports this module at load time

    try:
        listing = parse_workers(body)
    except ValueError as exc:
        return [pf.Report(shown, reason=pf._one_line(exc), role=ROUTER_ROLE, router=shown)]
    if not listing.workers:
        return [pf.Report(shown, reason=NO_WORKERS, role=ROUTER_ROLE, router=shown)]

    def one(w: RouterWorker) -> Report:
        if not w.http:
            rep = pf.Report(pf.display_url(w.url), reason=grpc_reason(w))
        else:
            # read as a server only: a router listed as a worker (or listing itself) must not loop
            [rep] = pf.check(w.url, timeout_s=timeout_s, token=token, transport=transport, follow_router=False)
        note = type_note(w.worker_type, rep.role)
        if rep.role is None:
            rep.role = ROLE_OF_WORKER_TYPE.get(w.worker_type or "")
        rep.router, rep.router_worker_type = shown, w.worker_type
        rep.notes += [n for n in (note, health_note(w), dp_note(w)) if n]
        return rep

    workers = sorted(listing.workers, key=lambda w: (_TYPE_ORDER.get(w.worker_type or "", 3), w.url))
    with ThreadPoolExecutor(max_workers=min(_MAX_WORKERS, len(workers))) as pool:
        reports = list(pool.map(one, workers))
    missing = missing_role(listing)
    if missing:
        reports.append(pf.Report(shown, reason=missing, role=ROUTER_ROLE, router=shown))
    return reports


def render_group(group: Sequence[Report]) -> str:
    """The text of one ``--url``'s reports; a router's start with a line naming it and what it lists."""
    from . import render as pf

    text = "\n\n".join(pf.render_text(r) for r in group)
    if not group or group[0].router is None:
        return text
    workers = [r for r in group if r.role != ROUTER_ROLE]
    if not workers:
        return text
    types = [r.router_worker_type or "untyped" for r in workers]
    kinds = ", ".join(f"{types.count(t)} {t}" for t in dict.fromkeys(types))
    return (
        f"{group[0].router}: SGLang router listing {len(workers)} worker{'s' if len(workers) != 1 else ''} "
        f"({kinds}); each is checked directly:\n\n{text}"
    )
