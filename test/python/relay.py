"""A TCP relay between a client and rgpu-opserver that cuts its connections on demand: the
flaky network of the resume tests."""

import socket
import threading


class Relay:
    """Listens on 127.0.0.1 (`port`) and forwards each connection to `target` (host, port).
    `cut()` drops every connection now; `cut_after(direction, n)` drops them once `n` more
    bytes have gone "up" (client to server) or "down"."""

    def __init__(self, target):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.pairs = []
        self.cuts = 0
        self.armed = None  # (direction, bytes left)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            pair = (client, server)
            with self.lock:
                self.pairs.append(pair)
            threading.Thread(target=self._pump, args=(client, server, "up", pair), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down", pair), daemon=True).start()

    def _pump(self, src, dst, direction, pair):
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                self._drop(pair)
                return
            with self.lock:
                armed = self.armed
                if armed and armed[0] == direction:
                    left = armed[1] - len(data)
                    if left <= 0:
                        self.armed = None
                        data = data[:armed[1]]
                    else:
                        self.armed = (direction, left)
            try:
                dst.sendall(data)
            except OSError:
                self._drop(pair)
                return
            if armed and armed[0] == direction and armed[1] - len(data) <= 0:
                self.cut()
                return

    def _drop(self, pair):
        with self.lock:
            if pair in self.pairs:
                self.pairs.remove(pair)
        for s in pair:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def cut(self):
        """Drops every open connection; returns how many."""
        with self.lock:
            pairs, self.pairs = self.pairs, []
            self.cuts += bool(pairs)
        for pair in pairs:
            for s in pair:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        return len(pairs)

    def cut_after(self, direction, nbytes):
        with self.lock:
            self.armed = (direction, nbytes)

    def close(self):
        self.listener.close()
        self.cut()
