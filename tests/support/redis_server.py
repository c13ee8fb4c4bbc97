"""A throwaway real redis-server (Debian's, installed by `make apt`) for the ledger tests of
every layer (tests/conftest.py makes it the ``redis_server`` fixture)."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

REDIS_SERVER = "/usr/bin/redis-server"


class RedisServer:
    """A throwaway redis-server that can be killed and restarted on the same port."""

    def __init__(self, workdir):
        if not os.path.exists(REDIS_SERVER):
            pytest.fail(f"{REDIS_SERVER} is missing: run `make apt` (installs redis-server; CI has it)")
        self.workdir = str(workdir)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.workdir,
                "--enable-debug-command",
                "local",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        import redis

        client = redis.Redis(port=self.port, socket_timeout=1)
        for _ in range(200):
            try:
                client.ping()
                return self
            except redis.RedisError:
                if self.proc.poll() is not None:
                    pytest.fail(f"redis-server exited with {self.proc.returncode}")
                time.sleep(0.05)
        pytest.fail("redis-server did not answer within 10 s")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=2)
