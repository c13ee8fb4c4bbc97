"""kvguard command line: ``kvguard sidecar`` and ``kvguard demo``."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from engine_hooks.ring import ring_dir


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"--listen must be HOST:PORT, got {value!r}")
    return host or "127.0.0.1", int(port)


def cmd_sidecar(args) -> int:
    import uvicorn

    from .api import create_app
    from .service import Sidecar
    from .sinks.basic import JsonLinesSink, LogSink

    sinks = [LogSink()] + ([JsonLinesSink(sys.stdout)] if args.json else [])
    sidecar = Sidecar(args.ring_dir, sinks=sinks).start()
    host, port = args.listen
    server = uvicorn.Server(uvicorn.Config(create_app(sidecar), host=host, port=port, log_level="warning"))
    logging.getLogger("kvguard").info("kvguard sidecar: rings in %s, serving http://%s:%d", args.ring_dir, host, port)
    try:
        server.run()
    finally:
        sidecar.stop()
    return 0


def cmd_demo(args) -> int:
    from .demo.run import run_demo

    return run_demo(sglang_version=args.sglang, as_json=args.json, workdir=args.workdir, keep=args.keep)


# Commands that live in their own modules register themselves: module path -> the
# name of a function ``register(subparsers)`` that adds a subparser with ``func`` set.
COMMAND_MODULES: list[tuple[str, str]] = []


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(prog="kvguard", description="KV-cache integrity sidecar for LLM serving engines")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for module, func in COMMAND_MODULES:
        getattr(importlib.import_module(module), func)(sub)

    p = sub.add_parser("sidecar", help="watch engine rings, raise findings, serve /metrics and /healthz")
    p.add_argument("--ring-dir", default=ring_dir(), help="directory of engine rings (default $KVGUARD_RING_DIR "
                   "or /dev/shm/kvguard)")
    p.add_argument("--listen", type=parse_listen, default=("127.0.0.1", 9464), help="HOST:PORT (default "
                   "127.0.0.1:9464)")
    p.add_argument("--json", action="store_true", help="print one JSON object per finding on stdout")
    p.set_defaults(func=cmd_sidecar)

    p = sub.add_parser("demo", help="catch the 2026 KV exposure on a real SGLang prefill/decode pair on CPU")
    p.add_argument("--sglang", default="0.5.19", choices=["0.5.19", "0.5.23"],
                   help="0.5.19 still leaks (default); 0.5.23 has the fix")
    p.add_argument("--json", action="store_true", help="print the findings as JSON lines instead of the story")
    p.add_argument("--workdir", default=None, help="where logs and rings go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.set_defaults(func=cmd_demo)
    return parser


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
