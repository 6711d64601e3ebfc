"""An HTTP proxy on 127.0.0.1 that drops requests on a schedule: the endpoint that dies mid-sign-off, for tests.

Each request is forwarded on its own upstream connection (`Connection: close`), so the schedule counts requests,
not connections. `plan(i)` decides the i-th request (from 0): "pass", "reset" (the client's connection is reset
before anything is forwarded), or "cut" (forwarded, then reset after half the answer: the server did the work).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
    sock.close()


def _read_request(conn: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        body += chunk
    lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body


class FaultProxy:
    def __init__(self, upstream_port: int, plan: Callable[[int], str]):
        self.upstream_port, self.plan = upstream_port, plan
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.count = 0
        self.actions: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        request = _read_request(conn)
        if request is None:
            conn.close()
            return
        with self._lock:
            action = self.plan(self.count)
            self.count += 1
            self.actions.append(action)
        if action == "reset":
            _reset(conn)
            return
        answer = b""
        with socket.create_connection(("127.0.0.1", self.upstream_port)) as up:
            up.sendall(request)
            while chunk := up.recv(65536):
                answer += chunk
        if action == "cut":
            conn.sendall(answer[:len(answer) // 2])
            _reset(conn)
            return
        conn.sendall(answer)
        conn.close()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in the other thread
        except OSError:
            pass
        self.sock.close()
