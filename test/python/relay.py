"""A TCP relay between a client and rgpu-opserver that cuts its connections on demand: the
flaky network of the resume tests."""

import socket
import threading
import time


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
        self.armed = {}  # direction -> bytes left before a cut
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
            pair = (client, server, time.monotonic(), {"up": 0, "down": 0})
            with self.lock:
                self.pairs.append(pair)
            threading.Thread(target=self._pump, args=(client, server, "up", pair), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down", pair), daemon=True).start()

    def rewrite(self, direction, data, state):
        """What to forward for `data` read going `direction`: itself here; a subclass may
        change it (`state` is a dict of the pump's own, for as long as its connection)."""
        return data

    def _pump(self, src, dst, direction, pair):
        state = {}
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                self._drop(pair)
                return
            data = self.rewrite(direction, data, state)
            if not data:
                continue
            cut = False
            pair[3][direction] += 1
            with self.lock:
                if direction in self.armed:
                    left = self.armed[direction]
                    if len(data) >= left:
                        data, cut = data[:left], True
                        del self.armed[direction]
                    else:
                        self.armed[direction] = left - len(data)
            try:
                dst.sendall(data)
            except OSError:
                self._drop(pair)
                return
            if cut:
                self.cut()
                return

    def _drop(self, pair):
        with self.lock:
            if pair in self.pairs:
                self.pairs.remove(pair)
        self._close(pair)

    @staticmethod
    def _close(pair):
        for s in pair[:2]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def cut(self, settled=False):
        """Drops every connection (with `settled`, only those past their handshake: two reads
        each way, the Hello and a frame after it up, the challenge or Hello's reply and more
        down); returns how many."""
        with self.lock:
            old = [p for p in self.pairs if not settled or min(p[3].values()) >= 2]
            self.pairs = [p for p in self.pairs if p not in old]
            self.cuts += bool(old)
        for pair in old:
            self._close(pair)
        return len(old)

    def cut_one(self, timeout=10.0):
        """Cuts once, as soon as a connection is past its handshake (a cut in the middle of a
        Hello fails that reconnect, which is retried, not resumed): every such cut costs the
        client exactly one resume."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.cut(settled=True):
            time.sleep(0.005)

    def cut_after(self, direction, nbytes):
        with self.lock:
            self.armed[direction] = nbytes

    def close(self):
        self.listener.close()
        self.cut()
