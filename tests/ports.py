"""A free loopback port, for tests that start a listener of their own (servers, process groups).

Kept apart from tests/server/conftest.py, which imports the openai client: GPU machines lack it, and the
GPU tests that need a port must still import there.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
