"""kvguard command line: ``kvguard sidecar`` and ``kvguard demo``."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import sys

from kvguard.engine_hooks.ring import ring_dir

from .http_server import DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_TIMEOUT_S, check_limits
from .ingest import DEFAULT_MAX_RINGS, fd_limit, raise_fd_limit


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


# exit codes (every subcommand's help lists those it uses)
EXIT_OK, EXIT_FAILED, EXIT_BAD_CONFIG, EXIT_RING_DIR_BUSY, EXIT_PORT_IN_USE = 0, 1, 2, 3, 4
EXIT_LEDGER_UNREACHABLE, EXIT_INTERRUPTED = 5, 130


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (127.0.0.1); refused here, with the reason,
    whatever the server could not listen on as meant (a bare IPv6 address, port 0)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT ([IPv6]:PORT for IPv6), got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host or ":" not in host:
            raise argparse.ArgumentTypeError(f"brackets hold an IPv6 address, got {value!r}")
    elif ":" in host:
        raise argparse.ArgumentTypeError(f"an IPv6 address goes in brackets: [{host}]:{port}, got {value!r}")
    if int(port) == 0:
        raise argparse.ArgumentTypeError(
            f"port 0 (any free port) is refused: Prometheus and the kubelet's probes need to know it, got {value!r}"
        )
    if not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"port {port} is outside 1-65535, got {value!r}")
    return host or "127.0.0.1", int(port)


def bind_listener(host: str, port: int):
    """The HTTP listening socket, bound before anything else starts, so that a taken port is
    said at once (exit 4) instead of after the sidecar began reading rings."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def load_api_token(path: str | None) -> str | None:
    """The /v1 bearer token: from --api-token-file, else $KVGUARD_API_TOKEN, else None (/v1 disabled)."""
    from .secrets import read_secret

    token, source = read_secret(path, "--api-token-file", "KVGUARD_API_TOKEN")  # (ValueError: unreadable)
    if path and not token:
        raise ValueError(f"{source} is empty")
    return token or None


def alert_sinks(args) -> list:
    """PagerDuty and Alertmanager sinks from the command line (ValueError names a bad setting)."""
    out = []
    if args.pagerduty or args.pagerduty_routing_key_file:
        from .sinks.pagerduty import DEFAULT_URL, load_routing_key, pagerduty_sink

        key = load_routing_key(args.pagerduty_routing_key_file)
        url = args.pagerduty_url or DEFAULT_URL
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--pagerduty-url: expected an http(s) URL, got {url!r}")
        out.append(pagerduty_sink(key, url))
    if args.alertmanager_url:
        from .sinks.alertmanager import alertmanager_sink

        out.append(alertmanager_sink(args.alertmanager_url))
    return out


def ledger_settings(args) -> dict:
    """--ledger (default $KVGUARD_LEDGER, else memory), --ledger-cluster, --orphan-timeout-s; a bad value
    raises ValueError naming the setting and the value."""
    from .ledger.shared import parse_ledger_url

    source = "--ledger" if args.ledger is not None else "KVGUARD_LEDGER"
    value = args.ledger if args.ledger is not None else os.environ.get("KVGUARD_LEDGER", "memory")
    parse_ledger_url(value, source)
    if not args.orphan_timeout_s > 0:
        raise ValueError(f"--orphan-timeout-s: expected seconds > 0, got {args.orphan_timeout_s}")
    return {"ledger": value, "ledger_cluster": args.ledger_cluster, "orphan_timeout_s": args.orphan_timeout_s}


def cmd_sidecar(args) -> int:
    from .lockfile import RingDirBusy, lock_ring_dir
    from .sinks.basic import JsonLinesSink, LogSink

    sinks = [LogSink()] + ([JsonLinesSink(sys.stdout)] if args.json else [])
    try:
        sinks += alert_sinks(args)
    except ValueError as exc:  # bad configuration fails at start-up, naming the setting
        print(f"kvguard sidecar: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    from .finding_logs import from_env as finding_logs_from_env
    from .tracing import from_env as tracing_from_env

    try:
        token = load_api_token(args.api_token_file)
        tracer = tracing_from_env()  # OTEL_* variables; None (off) unless an exporter or an endpoint is set
        # findings as OTLP log records, configured by the same variables (OTEL_LOGS_EXPORTER, ...)
        finding_logs = finding_logs_from_env(tracer=tracer)
        ledger = ledger_settings(args)
        check_limits(args.http_max_connections, args.http_request_timeout_s)
    except ValueError as exc:  # a bad tracing, ledger or HTTP setting: named with its value
        print(f"kvguard sidecar: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if args.ledger_required:  # fail fast (and be restarted) rather than pair nothing across pods
        from .ledger.shared import parse_ledger_url, ping_ledger

        url = parse_ledger_url(ledger["ledger"])
        if url is None:
            print(
                f"kvguard sidecar: --ledger-required: the ledger is {ledger['ledger']!r}, not a shared one "
                "(--ledger redis://HOST:PORT/DB or $KVGUARD_LEDGER)",
                file=sys.stderr,
            )
            return EXIT_BAD_CONFIG
        why = ping_ledger(url)
        if why is not None:
            print(f"kvguard sidecar: --ledger-required: the shared ledger cannot be reached: {why}", file=sys.stderr)
            return EXIT_LEDGER_UNREACHABLE
    # one sidecar per ring directory: a second one would split every ring's records with the
    # first. Taken before anything touches shared state (the recorder closes segments left open)
    try:
        lock_fd = lock_ring_dir(args.ring_dir)
    except RingDirBusy as exc:
        print(f"kvguard sidecar: {exc}", file=sys.stderr)
        return EXIT_RING_DIR_BUSY
    except OSError as exc:
        print(f"kvguard sidecar: --ring-dir {args.ring_dir}: cannot create its lock file: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    listeners: list = []
    try:
        for flag, address in (("--listen", args.listen), ("--health-listen", args.health_listen)):
            if address is None:
                listeners.append(None)
                continue
            host, port = address
            try:
                listeners.append(bind_listener(host, port))
            except OSError as exc:
                where = f"{flag} {'[' + host + ']' if ':' in host else host}:{port}"
                if exc.errno == errno.EADDRINUSE:
                    print(f"kvguard sidecar: {where}: the port is already in use", file=sys.stderr)
                    return EXIT_PORT_IN_USE
                print(f"kvguard sidecar: {where}: cannot listen there: {exc.strerror or exc}", file=sys.stderr)
                return EXIT_BAD_CONFIG
        return _run_sidecar(args, sinks, token, tracer, ledger, listeners[0], listeners[1], finding_logs)
    finally:
        for listener in listeners:
            if listener is not None:
                listener.close()
        if lock_fd is not None:
            os.close(lock_fd)  # the lock goes with it (the kernel would release it at exit anyway)


def _run_sidecar(args, sinks, token, tracer, ledger: dict, listener, health_listener=None, finding_logs=None) -> int:
    import uvicorn

    from .api import create_app
    from .service import Sidecar

    recorder = None
    if args.record_dir:
        from .recorder import Recorder, RecordingError

        try:
            recorder = Recorder(args.record_dir, max_bytes=args.record_max_bytes, max_age_s=args.record_max_age)
        except (RecordingError, ValueError) as exc:
            print(f"kvguard sidecar: --record-dir: {exc}", file=sys.stderr)
            return EXIT_BAD_CONFIG
    raise_fd_limit(args.max_rings)  # the soft limit up to the hard one, as far as --max-rings needs
    try:
        sidecar = Sidecar(
            args.ring_dir,
            sinks=sinks,
            recorder=recorder,
            history_events=args.history_events,
            isolate_tenants=args.isolate_tenants,
            detect_prefix_probing=args.detect_prefix_probing,
            tracer=tracer,
            finding_logs=finding_logs,
            ttft_anomaly=args.ttft_anomaly,
            max_rings=args.max_rings,
            memory_budget=args.memory_budget,
            **ledger,
        ).start()
    except ValueError as exc:  # a bad ledger setting or a budget too small: named with its value
        print(f"kvguard sidecar: {exc}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    # what a bundle of an incident shows of this sidecar's settings (sidecar/bundle.py): the
    # command line as parsed, secrets' values never (sidecar/secrets.py redact_settings)
    from .secrets import redact_settings

    sidecar.settings = redact_settings({k: v for k, v in vars(args).items() if k != "func"})
    # long-lived state out of every garbage collection (their pauses held /healthz past 100 ms)
    from .gc_policy import GcFreeze

    gc_freeze = sidecar.gc_freeze = GcFreeze()
    gc_freeze.freeze_now()  # the libraries' and start-up objects
    sidecar.between_cycles.append(gc_freeze.maybe_run)
    if token is None:
        logging.getLogger("kvguard").warning("no API token configured: /v1 (incidents, timelines) answers 403")
    from . import native

    logging.getLogger("kvguard").info("sidecar kernels: %s", native.status())  # (which path judges: both agree)
    cap = sidecar.rings.ring_cap
    if cap < args.max_rings:
        logging.getLogger("kvguard").warning(
            "the file descriptor limit (%d) allows %d attached rings, fewer than --max-rings %d: rings past %d wait "
            "(raise the limit: ulimit -n)",
            fd_limit(),
            cap,
            args.max_rings,
            cap,
        )
    host, port = args.listen
    app = create_app(sidecar, api_token=token)
    from .http_server import guarded_protocol

    # bounded: at most --http-max-connections open connections, each with a deadline for its
    # request head (sidecar/http_server.py); requests past the cap are answered 503
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            limit_concurrency=args.http_max_connections,
            http=guarded_protocol(args.http_max_connections, args.http_request_timeout_s),
        )
    )
    logging.getLogger("kvguard").info(
        "kvguard sidecar: rings in %s, serving http://%s:%d%s",
        args.ring_dir,
        host,
        port,
        "" if args.health_listen is None else ", probes on http://%s:%d" % args.health_listen,
    )
    try:
        # uvicorn shuts down gracefully on SIGTERM/SIGINT, then raises the signal again: SIGTERM
        # reaches main()'s handler (exit 0 once this finally has run), SIGINT is a KeyboardInterrupt (130)
        if health_listener is None:
            server.run(sockets=[listener])
        else:
            asyncio.run(_serve_with_probes(server, listener, health_listener, sidecar.healthy))
    finally:
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut this short
        try:
            sidecar.stop()  # drain the rings, finish the recording's segment, close rings and sinks
            logging.getLogger("kvguard").info("kvguard sidecar: stopped cleanly")
        finally:
            signal.signal(signal.SIGTERM, previous)
    return EXIT_OK


async def _serve_with_probes(server, listener, health_listener, healthy) -> None:
    """The API server and the probes' own listener (sidecar/health_server.py) in one event loop."""
    from . import health_server

    probes = await health_server.start(health_listener, healthy)
    try:
        await server.serve(sockets=[listener])
    finally:
        probes.close()
        await probes.wait_closed()


# Commands that live in their own modules register themselves: module path -> the
# name of a function ``register(subparsers)`` that adds a subparser with ``func`` set.
COMMAND_MODULES: list[tuple[str, str]] = [
    ("kvguard.sidecar.preflight", "register"),
    ("kvguard.sidecar.replay", "register"),
    ("kvguard.sidecar.dashboards_cli", "register"),
    ("kvguard.sidecar.isolation_cli", "register"),
    ("kvguard.sidecar.bundle_cli", "register"),
    ("kvguard.sidecar.canary.cli", "register"),
]


# `kvguard demo` and `kvguard model` come from the kvguard-demo distribution (demo/),
# which engine and sidecar images do not install; without it they say where it is.
DEMO_COMMANDS = {
    "demo": "catch the 2026 KV exposure on a real SGLang prefill/decode pair on CPU",
    "model": "write test models for the engine demos and tests",
}


def _register_demo(sub) -> None:
    try:
        from kvguard.demo.cli import register
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("kvguard.demo"):
            raise
        for name, help_text in DEMO_COMMANDS.items():
            p = sub.add_parser(name, help=f"{help_text} (needs kvguard-demo)")
            p.set_defaults(func=_demo_missing)
        return
    register(sub)


def _demo_missing(args) -> int:
    print(
        f"kvguard {args.command}: the kvguard-demo package is not installed "
        "(from a checkout: `make venv`, or pip install -e . -e demo/)",
        file=sys.stderr,
    )
    return 1


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="kvguard", description="KV-cache integrity sidecar for LLM serving engines")
    parser.add_argument("--version", action="version", version=f"kvguard {package_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=os.environ.get("KVGUARD_LOG_FORMAT", "text"),
        help="log lines as text or one JSON object each (default $KVGUARD_LOG_FORMAT, else text)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module, func in COMMAND_MODULES:
        getattr(importlib.import_module(module), func)(sub)
    _register_demo(sub)

    p = sub.add_parser(
        "sidecar",
        help="watch engine rings, raise findings, serve /metrics and /healthz",
        epilog=SIDECAR_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--ring-dir",
        default=ring_dir(),
        help="directory of engine rings (default $KVGUARD_RING_DIR or /dev/shm/kvguard)",
    )
    p.add_argument(
        "--listen", type=parse_listen, default=("127.0.0.1", 9464), help="HOST:PORT (default 127.0.0.1:9464)"
    )
    p.add_argument(
        "--health-listen",
        type=parse_listen,
        default=None,
        help="also answer /healthz and /readyz, and only those, on this HOST:PORT: point the kubelet's "
        "probes here so that a connection flood on --listen cannot fail them (off by default)",
    )
    p.add_argument(
        "--http-max-connections",
        type=_positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="most HTTP connections open at once; more are closed at once (default %(default)s)",
    )
    p.add_argument(
        "--http-request-timeout-s",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="close a connection that has not sent a complete request head this long after it "
        "connected or got its last answer (default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per finding on stdout")
    p.add_argument(
        "--pagerduty",
        action="store_true",
        help="page PagerDuty (Events API v2) with the routing key in $KVGUARD_PAGERDUTY_ROUTING_KEY",
    )
    p.add_argument(
        "--pagerduty-routing-key-file",
        default=None,
        help="file holding the PagerDuty routing key (implies --pagerduty)",
    )
    p.add_argument(
        "--pagerduty-url", default=None, help="Events API endpoint (default: PagerDuty's; for proxies and tests)"
    )
    p.add_argument("--alertmanager-url", default=None, help="post alerts to this Alertmanager (http://HOST:9093)")
    p.add_argument(
        "--ttft-anomaly",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="flag requests whose time to first token is implausibly short for their uncached prompt "
        "and whose forwards did not write it (ttft_anomaly; on by default)",
    )
    p.add_argument(
        "--isolate-tenants",
        action="store_true",
        help="report prefix-cache pages written by one tenant and read by another "
        "(cross_tenant_prefix_share), and one tenant walking another's cached prompt a few "
        "tokens at a time (prefix_probing); off by default",
    )
    p.add_argument(
        "--detect-prefix-probing",
        action="store_true",
        help="report one tenant walking another tenant's cached prompt a few tokens at a time "
        "(prefix_probing) where tenants share the prefix cache on purpose; implied by --isolate-tenants",
    )
    p.add_argument(
        "--api-token-file",
        default=None,
        help="file holding the bearer token for /v1 (default: $KVGUARD_API_TOKEN; without one /v1 answers 403)",
    )
    p.add_argument(
        "--ledger",
        default=None,
        help="where transfers are paired: 'memory' (one sidecar sees "
        "prefill and decode) or a Redis shared by the prefill and decode pods' sidecars: redis://HOST:PORT/DB "
        "(rediss:// for TLS), a Redis Cluster redis+cluster://HOST:PORT[,HOST:PORT...], or a Sentinel-managed "
        "master redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB] (default $KVGUARD_LEDGER, else memory)",
    )
    p.add_argument(
        "--ledger-cluster",
        default=os.environ.get("KVGUARD_CLUSTER", "default"),
        help="name of this deployment in a shared ledger, so that two clusters sharing one Redis "
        "never pair each other's transfers (default $KVGUARD_CLUSTER, else 'default')",
    )
    p.add_argument(
        "--ledger-required",
        action="store_true",
        help="exit 5 at start-up when the shared ledger does not answer (one round trip, 5 s), instead of "
        "starting with cross-pod pairing degraded",
    )
    p.add_argument(
        "--orphan-timeout-s",
        type=float,
        default=120.0,
        help="report decode pages reserved for a "
        "transfer whose prefill never reported within this many seconds (orphan_transfer; default 120)",
    )
    p.add_argument(
        "--max-rings",
        type=_positive_int,
        default=DEFAULT_MAX_RINGS,
        help="most engine rings attached at once; more are counted in kvguard_ring_errors_total and "
        "wait until one detaches (default %(default)s; each ring holds 2 file descriptors, and a "
        "lower file descriptor limit lowers it)",
    )
    p.add_argument(
        "--history-events",
        type=_positive_int,
        default=1 << 20,
        help="events kept for timelines (40 bytes each; default 1048576)",
    )
    from .memory_budget import DEFAULT_BUDGET_BYTES
    from .recorder import DEFAULT_MAX_BYTES, parse_bytes, parse_seconds

    p.add_argument(
        "--memory-budget",
        type=parse_bytes,
        default=DEFAULT_BUDGET_BYTES,
        help="what the sidecar's state may cost, e.g. 384M, 1G (default 384M, for a 512Mi limit): the "
        "ended-request directories get what the runtime, the history and the engines' page models "
        "leave; kvguard_memory_bytes{part} shows the estimate (docs/operations.md, Sizing)",
    )

    p.add_argument(
        "--record-dir",
        default=None,
        help="record the record stream into rotating segment files "
        "here, for `kvguard replay` (docs/recording-api.md); off by default",
    )
    p.add_argument(
        "--record-max-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_BYTES,
        help="disk budget of the "
        "recording, all segments together, e.g. 512M, 4G (default 1G); oldest segments go first",
    )
    p.add_argument(
        "--record-max-age",
        type=parse_seconds,
        default=None,
        help="delete segments older than this, "
        "e.g. 90m, 24h, 7d (default: only --record-max-bytes bounds the recording)",
    )
    p.set_defaults(func=cmd_sidecar)

    # -v / --verbose and --log-format after the subcommand too (`kvguard sidecar -v`), where
    # users write them (SUPPRESS: given there, they override the top level's; absent, they do not)
    for subparser in sub.choices.values():
        if not any("--verbose" in a.option_strings for a in subparser._actions):
            subparser.add_argument(
                "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging"
            )
        if not any("--log-format" in a.option_strings for a in subparser._actions):
            subparser.add_argument(
                "--log-format", choices=LOG_FORMATS, default=argparse.SUPPRESS, help="log lines as text or JSON"
            )
    return parser


LOG_FORMATS = ("text", "json")


def configure_logging(verbose: bool, log_format: str) -> None:
    """Log to stderr, as text or as one JSON object per line (python-json-logger: the fields a
    log pipeline indexes, ``time``, ``level``, ``logger``, ``message``, and ``exc_info`` with
    the traceback)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(
            JsonFormatter(
                "%(asctime)s %(levelname)s %(name)s %(message)s",
                rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # (not force=True: a host that configured logging already, such as a test runner calling
    # main() in its own process, keeps its handlers; the command line owns a fresh process's)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])


def package_version() -> str:
    """The installed distribution's version (what ``pip`` installed), else the source tree's."""
    from importlib import metadata

    try:
        return metadata.version("kvguard")
    except metadata.PackageNotFoundError:
        from kvguard import __version__

        return __version__


SIDECAR_EPILOG = """exit codes:
  0    stopped cleanly (SIGTERM)
  1    failed while running
  2    bad configuration: the setting and its value are named
  3    another sidecar holds --ring-dir (one sidecar per ring directory)
  4    --listen or --health-listen: the port is already in use
  5    --ledger-required: the shared ledger does not answer
  130  interrupted (SIGINT)

environment:
  KVGUARD_RING_DIR                 --ring-dir's default (/dev/shm/kvguard)
  KVGUARD_LOG_FORMAT               --log-format's default (text or json)
  KVGUARD_LEDGER, KVGUARD_CLUSTER  --ledger's and --ledger-cluster's defaults
  KVGUARD_LEDGER_PASSWORD          the shared ledger's password (keep it out of the URL)
  KVGUARD_API_TOKEN                the /v1 bearer token when no --api-token-file
  KVGUARD_PAGERDUTY_ROUTING_KEY    the routing key for --pagerduty
  KVGUARD_JUDGE                    incremental (default) or full: how reads are judged
  OTEL_*                           OpenTelemetry export: traces, and findings as log records
                                   (docs/tracing.md)
"""


class Terminated(Exception):
    """SIGTERM: the ordinary way to stop a service (Kubernetes, systemd). Raised out of whatever
    runs, so that its ``finally`` blocks shut down cleanly; the process then exits 0."""


def _terminate(signum, frame):
    raise Terminated(f"signal {signum}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.log_format not in LOG_FORMATS:  # (from $KVGUARD_LOG_FORMAT: the parser checks only the flag)
        parser.error(f"KVGUARD_LOG_FORMAT={args.log_format!r}: expected one of {', '.join(LOG_FORMATS)}")
    configure_logging(args.verbose, args.log_format)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args)
    except Terminated:  # asked to stop, and stopped cleanly: not a failure
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
