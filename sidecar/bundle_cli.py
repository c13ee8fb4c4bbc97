"""``kvguard bundle INCIDENT``: the incident's bundle (sidecar/bundle.py) in one file, from a
running sidecar (``GET /v1/incidents/{id}/bundle``) or from a recording (replayed here).

Exit codes: 0 written; 1 could not (the sidecar unreachable or failing, a recording
unreadable, the file not writable); 2 bad arguments; 3 no such incident (on the sidecar,
or in the recording's replay). A bundle whose recording does not reproduce the incident is
still written (it is evidence): stderr and the manifest's ``replay_check`` say so.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request

from . import bundle
from .isolation_cli import DEFAULT_URL
from .secrets import read_secret

EXIT_OK, EXIT_FAILED, EXIT_BAD_ARGS, EXIT_NO_INCIDENT = 0, 1, 2, 3
INCIDENT_ID = re.compile(r"^inc-[0-9a-f]{16}$")
TIMEOUT_S = 120.0  # the sidecar copies up to --max-recording-mb of segments before it answers


def _incident_id(value: str) -> str:
    if not INCIDENT_ID.match(value):
        raise argparse.ArgumentTypeError(f"expected an incident id like inc-0123456789abcdef, got {value!r}")
    return value


def _positive(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}")
    return number


def download(url: str, token: str, incident_id: str, out_path: str, before_s: float, max_mb: int) -> None:
    """The sidecar's bundle into ``out_path``. LookupError: no such incident; ValueError: anything
    else, said with the URL."""
    query = urllib.parse.urlencode({"before_s": before_s, "max_recording_mb": max_mb})
    request = urllib.request.Request(
        f"{url.rstrip('/')}/v1/incidents/{incident_id}/bundle?{query}",
        headers={"Authorization": f"Bearer {token}"} if token else {},
    )
    tmp = f"{out_path}.download-{os.getpid()}"
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response, open(tmp, "wb") as f:
            while block := response.read(1 << 20):
                f.write(block)
        os.replace(tmp, out_path)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise LookupError(f"no incident {incident_id} on the sidecar at {url}") from exc
        hint = (
            " (give the sidecar's /v1 token: --api-token-file or $KVGUARD_API_TOKEN)" if exc.code in (401, 403) else ""
        )
        raise ValueError(f"{url}: HTTP {exc.code} {exc.reason}{hint}") from exc
    except urllib.error.URLError as exc:
        raise ValueError(f"cannot reach the sidecar at {url}: {exc.reason}") from exc
    except OSError as exc:
        raise ValueError(f"{url}: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cmd_bundle(args) -> int:
    out = args.output or bundle.default_out(args.incident)
    if os.path.isdir(out):
        out = os.path.join(out, bundle.default_out(args.incident))
    max_bytes = int(args.max_recording_mb) << 20
    try:
        if args.from_recording:
            problems: list[str] = []
            manifest = bundle.from_recording(
                args.from_recording,
                args.incident,
                out,
                before_s=args.before_s,
                max_recording_bytes=max_bytes,
                check=not args.no_check,
                on_problem=problems.append,
            )
            for message in problems[:20]:
                print(f"kvguard bundle: warning: {message}", file=sys.stderr)
        else:
            token, _source = read_secret(args.api_token_file, "--api-token-file", "KVGUARD_API_TOKEN")
            download(args.api, token, args.incident, out, args.before_s, args.max_recording_mb)
            fetched = bundle.read_manifest(out)
            if fetched is None:
                print(f"kvguard bundle: {args.api} answered something that is not a kvguard bundle", file=sys.stderr)
                os.unlink(out)
                return EXIT_FAILED
            manifest = fetched
            if not args.no_check and manifest.get("recording"):
                manifest = bundle.recheck(out)  # the route does not replay; the file is checked here
    except bundle.NoSuchIncident:
        where = " ".join(args.from_recording or ())
        print(f"kvguard bundle: no incident {args.incident} in the replay of {where}", file=sys.stderr)
        return EXIT_NO_INCIDENT
    except LookupError as exc:  # the sidecar answered 404
        print(f"kvguard bundle: {exc}", file=sys.stderr)
        return EXIT_NO_INCIDENT
    except (ValueError, bundle.RecordingError, OSError) as exc:
        print(f"kvguard bundle: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(bundle.describe(manifest, out), file=sys.stderr)
    print(out)  # stdout: the path only, for scripts
    return EXIT_OK


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bundle",
        help="one file about one incident for the engine team: incident, timeline, replayable recording, "
        "transfer facts, versions, settings (redacted), the incident view",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("incident", type=_incident_id, metavar="INCIDENT", help="the incident id (inc-…)")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--api", default=DEFAULT_URL, metavar="URL", help=f"a running sidecar's API (default {DEFAULT_URL})"
    )
    source.add_argument(
        "--from-recording",
        nargs="+",
        metavar="FILE",
        default=None,
        help="recorded segments, recording directories or a bundle: replayed here to find the incident",
    )
    p.add_argument("-o", "--output", default=None, help="where to write it (default ./kvguard-bundle-INCIDENT.tar.gz)")
    p.add_argument("--api-token-file", default=None, help="file holding the /v1 token (default: $KVGUARD_API_TOKEN)")
    p.add_argument(
        "--before-s",
        type=_positive,
        default=bundle.DEFAULT_BEFORE_S,
        help="recorded seconds kept before the incident and its reader's begin (default %(default)s)",
    )
    p.add_argument(
        "--max-recording-mb",
        type=lambda v: int(_positive(v)),
        default=bundle.DEFAULT_MAX_RECORDING_BYTES >> 20,
        help="most MiB of recording in the bundle; the oldest segments are left out first (default %(default)s)",
    )
    p.add_argument(
        "--no-check",
        action="store_true",
        help="do not replay the bundle's recording to check that it reproduces the incident",
    )
    p.set_defaults(func=cmd_bundle)
    return p
