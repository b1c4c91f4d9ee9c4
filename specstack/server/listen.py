"""The server's socket and its log lines, shared by one server (cli/serve.py) and the replicas' deploy
(cluster/deploy.py): bound before anything loads, so a busy port or a bad host fails at once."""
from __future__ import annotations

import socket
import sys

from specstack.errors import SpecstackError


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything loads, so a busy port fails at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SpecstackError(f"--host {host!r}: {e.strerror}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise SpecstackError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def note(message: str) -> None:
    print(f"specstack: {message}", file=sys.stderr, flush=True)
