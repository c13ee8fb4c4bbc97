"""Schemathesis against the sidecar's own OpenAPI schema: no 5xx, responses match the schema.

The app is driven in-process (ASGI) with a populated sidecar, authenticated, so the
generated requests reach the handlers and not only the token check.
"""

import numpy as np
import schemathesis
from hypothesis import HealthCheck, settings
from prometheus_client import CollectorRegistry

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.api import create_app
from kvguard.sidecar.service import Sidecar

TOKEN = "schema-token"


def _populated_app(tmp_dir: str):
    p = Probes(RingWriter(tmp_dir, 1 << 16))
    p.hello("unified", 0, 4, 64, 256, 256, 256, "sglang", "0.5.23", "tiny")
    for rid, tenant, wrote in (("r-a", "acme", 8), ("r-b", "globex", 4)):
        p.request_begin(rid, tenant, None, 8, 0, False)
        p.pages_allocated(np.arange(4, 12))
        p.rows_assigned(rid, 0, 8, 0, np.arange(4, 12))
        p.forward([rid], [8], [np.arange(4, 4 + wrote)], [np.arange(4, 12)])
        p.request_end(rid, "stop", 1, 2, 1, "")
        p.pages_freed(np.arange(4, 12))
    sidecar = Sidecar(tmp_dir, slack_ns=0).start()  # running: /healthz and /readyz answer 200
    return create_app(sidecar, CollectorRegistry(), api_token=TOKEN)


import tempfile  # noqa: E402

APP = _populated_app(tempfile.mkdtemp(prefix="kvguard-schema-"))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_schema(case):
    case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"})
