"""Process-group plumbing shared by trainer ranks and engines (below both)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous or a weight-sync group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
