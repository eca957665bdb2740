"""Where ranks on one machine meet: a free loopback port for a TCP rendezvous."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on the loopback that is free now (for a rendezvous on this machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
