"""A TCP relay that makes loopback look like a network: one-way delay and a bandwidth cap.

    python bench/relay.py --listen 127.0.0.1:0 --target 127.0.0.1:9720 --rtt-ms 20 --mbit 100

Each direction is its own link: a chunk is serialized onto the link at the capped rate (after
the chunks before it), then arrives rtt/2 later, in order. Prints "relay listening on HOST:PORT"
once it accepts connections. Used by bench/suite.py to run rgpu at realistic round-trip times.
"""

import argparse
import asyncio
import sys
import time


class Link:
    """One direction: bandwidth-limited serialization followed by a fixed propagation delay."""

    def __init__(self, delay_s, bytes_per_s):
        self.delay = delay_s
        self.rate = bytes_per_s
        self.free_at = 0.0

    def arrival(self, size):
        now = time.monotonic()
        start = max(now, self.free_at)
        self.free_at = start + (size / self.rate if self.rate else 0.0)
        return self.free_at + self.delay


async def pump(reader, writer, link):
    queue = asyncio.Queue()

    async def deliver():
        while True:
            item = await queue.get()
            if item is None:
                break
            at, data = item
            wait = at - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    sender = asyncio.create_task(deliver())
    try:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            await queue.put((link.arrival(len(data)), data))
    except ConnectionError:
        pass
    await queue.put(None)
    try:
        await sender
    except ConnectionError:
        pass


async def serve(listen, target, rtt_ms, mbit):
    host, port = listen.rsplit(":", 1)
    thost, tport = target.rsplit(":", 1)
    one_way = rtt_ms / 2000.0
    rate = mbit * 1e6 / 8 if mbit else 0

    async def handle(client_r, client_w):
        try:
            server_r, server_w = await asyncio.open_connection(thost, int(tport))
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pump(client_r, server_w, Link(one_way, rate)),
                             pump(server_r, client_w, Link(one_way, rate)))

    server = await asyncio.start_server(handle, host, int(port))
    bound = server.sockets[0].getsockname()
    print(f"relay listening on {bound[0]}:{bound[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--target", required=True, help="host:port of the real server")
    parser.add_argument("--rtt-ms", type=float, default=20.0, help="round-trip time to add")
    parser.add_argument("--mbit", type=float, default=100.0, help="bandwidth cap per direction "
                        "in Mbit/s (0: none)")
    args = parser.parse_args()
    try:
        asyncio.run(serve(args.listen, args.target, args.rtt_ms, args.mbit))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
