"""/healthz and /metrics, driven through a test client; the CLI's argument checks."""

import argparse

import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from kvguard.engine_hooks.probes import Probes
from kvguard.engine_hooks.ring import RingWriter
from kvguard.sidecar.api import create_app
from kvguard.sidecar.cli import build_parser, parse_listen
from kvguard.sidecar.service import Sidecar


def test_metrics_expose_records_pool_and_context(tmp_path):
    p = Probes(RingWriter(str(tmp_path), 4096))
    p.hello("prefill", 0, 4, 64, 256, 2048, 250, "sglang", "0.5.19", "tiny")
    p.pages_allocated(np.arange(8))
    sidecar = Sidecar(str(tmp_path), slack_ns=0)
    sidecar.run_once(flush=True)
    client = TestClient(create_app(sidecar, CollectorRegistry()))
    text = client.get("/metrics").text
    assert 'kvguard_records_total{kind="ALLOC"} 1.0' in text
    assert 'kvguard_kv_pool_tokens{pid="' in text and "} 256.0" in text
    assert 'kvguard_context_length_tokens{pid="' in text and "} 2048.0" in text
    assert 'kvguard_pages{pid="' in text and 'state="allocated"} 2.0' in text
    assert "kvguard_records_lost_total 0.0" in text
    sidecar.stop()


def test_healthz_is_503_until_ingest_runs_then_200(tmp_path):
    sidecar = Sidecar(str(tmp_path), poll_interval_s=0.01)
    client = TestClient(create_app(sidecar, CollectorRegistry()))
    assert client.get("/healthz").status_code == 503
    sidecar.start()
    try:
        import time

        for _ in range(100):
            if client.get("/healthz").status_code == 200:
                break
            time.sleep(0.02)
        body = client.get("/healthz").json()
        assert body["ingest_alive"] is True and body["rings_attached"] == 0
    finally:
        sidecar.stop()


@pytest.mark.parametrize("bad", ["9464", "host:", "host:99999", "host:abc"])
def test_listen_must_be_host_port(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="HOST:PORT|outside 1-65535"):
        parse_listen(bad)


def test_listen_defaults_to_localhost():
    args = build_parser().parse_args(["sidecar", "--ring-dir", "/tmp/x"])
    assert args.listen == ("127.0.0.1", 9464) and args.json is False
