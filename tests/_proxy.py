"""A TCP proxy on 127.0.0.1 that can lose one answer: the request that carries a marker reaches the server (so
it is applied there) and the server's reply on that connection is discarded until the client gives the
connection up. It stands for "the command ran, its reply was lost to a timeout" between the verifier and Redis.
Threads only, bounded: every connection ends when either side closes, and :meth:`close` ends them all."""

from __future__ import annotations

import socket
import threading

from _cluster import free_port


class ReplyDroppingProxy:
    """Forward 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``; :meth:`drop_reply_to` arms it once."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port = free_port()
        self.num_dropped = 0  # replies discarded so far
        self._marker: bytes | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True).start()

    def drop_reply_to(self, marker: bytes) -> None:
        """Discard the reply to the next request that contains ``marker`` (once)."""
        with self._lock:
            self._marker = marker

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            lost = threading.Event()  # this connection's replies are discarded
            threading.Thread(target=self._pump, args=(client, upstream, lost, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, lost, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, lost: threading.Event, requests: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if requests:
                    with self._lock:
                        if self._marker is not None and self._marker in data:
                            self._marker = None
                            self.num_dropped += 1
                            lost.set()
                elif lost.is_set():
                    continue  # the reply never reaches the client
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass
