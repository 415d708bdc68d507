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


class ByteFlippingProxy:
    """Forward 127.0.0.1:``port`` to a plaintext gRPC server at 127.0.0.1:``upstream_port``; once armed with
    :meth:`flip_next`, it flips one byte in the middle of the next large HTTP/2 DATA frame the server sends (a
    bit error the transport does not catch: the payload of a bytes field, so the message still parses). It parses
    the server's HTTP/2 frames (9-byte header + payload) to touch nothing but a DATA payload. Threads only,
    bounded: every connection ends when either side closes, and :meth:`close` ends them all."""

    MIN_FRAME = 4096  # DATA frames at least this long: inside a draft chunk's data, never a small answer

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.port = free_port()
        self.num_flipped = 0
        self._armed = 0
        self._lock = threading.Lock()
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True).start()

    def flip_next(self, times: int = 1) -> None:
        """Flip a byte in each of the next ``times`` large DATA frames from the server."""
        with self._lock:
            self._armed = times

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
            threading.Thread(target=self._pump_raw, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump_frames, args=(upstream, client), daemon=True).start()

    def _pump_raw(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _shut(src, dst)

    def _pump_frames(self, src: socket.socket, dst: socket.socket) -> None:
        buf = bytearray()
        try:
            while data := src.recv(65536):
                buf += data
                while len(buf) >= 9:
                    length = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + length:
                        break
                    frame = buf[:9 + length]
                    del buf[:9 + length]
                    if frame[3] == 0 and length >= self.MIN_FRAME and not frame[4] & 0x8:  # DATA, not padded
                        with self._lock:
                            if self._armed:
                                self._armed -= 1
                                self.num_flipped += 1
                                frame[9 + length // 2] ^= 0xFF
                    dst.sendall(bytes(frame))
        except OSError:
            pass
        finally:
            _shut(src, dst)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass


def _shut(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
