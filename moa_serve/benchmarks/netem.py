"""Network emulation for edge runs: two hosts on one machine and a link with mobile-like profiles.

    NamespaceHost   the server's host: a network namespace joined to ours by a veth pair
                    (10.<n>.0.1 here, 10.<n>.0.2 there), bandwidth shaped with `tc tbf` on both ends;
                    `cut()` / `restore()` take the link down and up. Needs root.
    LinkProxy       the client's side of the link, a TCP relay on 127.0.0.1 that adds one-way delay
                    with jitter and, with the loss probability per segment, a TCP retransmission timeout.

Why a relay for delay and loss: this kernel has no `sch_netem` ("Specified qdisc kind is unknown"),
so `tc netem` cannot run here; `tbf` can, so bandwidth is the kernel's. The relay keeps byte order
(a delayed segment also delays the ones behind it, as on a TCP connection) and models a lost
segment as TCP does to the application: the data arrives one RTO (200 ms, Linux's minimum) late.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    delay_ms: float  # one-way
    jitter_ms: float  # uniform +-
    loss: float  # per segment
    rate_mbit: float | None  # None = unshaped


PROFILES = {
    "lan": Profile("lan", 0.0, 0.0, 0.0, None),
    "5g": Profile("5g", 10.0, 10.0, 0.001, None),
    "4g": Profile("4g", 21.0, 19.0, 0.001, 20.0),
}
RTO_S = 0.2
SEGMENT = 1448  # bytes per TCP segment on a 1500-byte MTU


class LinkProxy:
    """127.0.0.1:<port> -> upstream, with the profile's delay/jitter/loss in both directions."""

    def __init__(self, upstream_host: str, upstream_port: int, profile: Profile, seed: int = 0):
        self.upstream = (upstream_host, upstream_port)
        self.profile = profile
        self.rng = random.Random(seed)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._ready = threading.Event()
        self._conns: set[asyncio.StreamWriter] = set()
        self.is_cut = False
        self._thread = threading.Thread(target=self._run, name="link-proxy", daemon=True)

    def __enter__(self) -> "LinkProxy":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("link proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        async def shutdown():
            for w in list(self._conns):
                w.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.loop.stop()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop)
        self._thread.join(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        """Link down: live connections reset, new ones refused, until restore()."""
        self.is_cut = True
        self.drop_connections()

    def restore(self) -> None:
        self.is_cut = False

    def drop_connections(self) -> None:
        """Reset every relayed connection (what a client sees when the radio link goes away)."""

        def close_all():
            for w in list(self._conns):
                w.transport.abort()

        self.loop.call_soon_threadsafe(close_all)

    def _delay(self, nbytes: int) -> float:
        p = self.profile
        d = max(0.0, p.delay_ms + self.rng.uniform(-p.jitter_ms, p.jitter_ms)) / 1000
        segments = max(1, -(-nbytes // SEGMENT))
        if p.loss and any(self.rng.random() < p.loss for _ in range(segments)):
            d += RTO_S
        return d

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def pipe(reader, writer):
            # NOTE: each chunk's delay runs from its arrival, and a sender task releases the chunks in
            # order: a link pipelines. Sleeping before reading the next chunk (an earlier relay)
            # added the delays of a message's chunks up (HTTP headers, then body: twice the one-way
            # delay), which made every edge cycle pay up to two round trips.
            queue: asyncio.Queue = asyncio.Queue()

            async def send():
                try:
                    while (item := await queue.get()) is not None:
                        wait = item[0] - time.monotonic()
                        if wait > 0:
                            await asyncio.sleep(wait)
                        writer.write(item[1])
                        await writer.drain()
                    if writer.can_write_eof():
                        writer.write_eof()  # after every byte read (drain() returns before the buffer is empty)
                except (ConnectionError, asyncio.CancelledError):
                    writer.transport.abort()

            sender = asyncio.create_task(send())
            release = 0.0
            try:
                while data := await reader.read(65536):
                    release = max(release, time.monotonic() + self._delay(len(data)))  # keeps byte order
                    queue.put_nowait((release, data))
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                queue.put_nowait(None)  # what was read still arrives, then the far side sees EOF
            await sender

        async def handle(creader, cwriter):
            if self.is_cut:
                cwriter.transport.abort()
                return
            try:
                ureader, uwriter = await asyncio.wait_for(asyncio.open_connection(*self.upstream), 5)
            except (OSError, asyncio.TimeoutError, asyncio.CancelledError):  # cancelled: shutdown while connecting
                cwriter.transport.abort()
                return
            self._conns.update((cwriter, uwriter))
            try:
                await asyncio.gather(pipe(creader, uwriter), pipe(ureader, cwriter))
            except asyncio.CancelledError:
                pass  # shutdown: ending quietly (re-raised, asyncio's server callback logs it as an error)
            finally:
                self._conns.difference_update((cwriter, uwriter))
                for w in (cwriter, uwriter):
                    w.close()  # both directions ended: flush what is buffered, then close

        async def start():
            server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()
        self.loop.close()


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=30)


class NamespaceHost:
    """A second host: network namespace + veth pair, optional tbf bandwidth limit. Root only."""

    def __init__(self, index: int, rate_mbit: float | None = None):
        self.ns = f"moa-edge-{index}"
        self.host_if, self.ns_if = f"moae{index}a", f"moae{index}b"
        self.host_ip, self.ns_ip = f"10.{200 + index % 50}.0.1", f"10.{200 + index % 50}.0.2"
        self.rate_mbit = rate_mbit
        self.subnet = f"10.{200 + index % 50}.0.0/24"

    def __enter__(self) -> "NamespaceHost":
        self._cleanup()
        _sh("ip", "netns", "add", self.ns)
        _sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        _sh("ip", "link", "set", self.ns_if, "netns", self.ns)
        _sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
        _sh("ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if)
        _sh("ip", "link", "set", self.host_if, "up")
        # NOTE: with the link down its connected route goes away and packets would follow the default
        # route off the machine; this blackhole (lower priority) drops them silently, like a dead radio link
        _sh("ip", "route", "add", "blackhole", self.subnet, "metric", "4000")
        _sh("ip", "netns", "exec", self.ns, "ip", "link", "set", self.ns_if, "up")
        _sh("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
        if self.rate_mbit:
            tbf = ("tbf", "rate", f"{self.rate_mbit}mbit", "burst", "32kbit", "latency", "400ms")
            _sh("tc", "qdisc", "add", "dev", self.host_if, "root", *tbf)
            _sh("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.ns_if, "root", *tbf)
        return self

    def __exit__(self, *exc) -> None:
        self._cleanup()

    def _cleanup(self) -> None:
        _sh("ip", "route", "del", "blackhole", self.subnet, check=False)
        _sh("ip", "link", "del", self.host_if, check=False)
        _sh("ip", "netns", "del", self.ns, check=False)

    def popen(self, cmd: list[str], **kw) -> subprocess.Popen:
        """Start a process inside the namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns, *cmd], **kw)

    def cut(self) -> None:
        _sh("ip", "link", "set", self.host_if, "down")

    def restore(self) -> None:
        _sh("ip", "link", "set", self.host_if, "up")


def namespaces_available() -> str | None:
    """None if namespaces + veth can be created here, else the reason."""
    import os

    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    probe = NamespaceHost(49)
    try:
        with probe:
            pass
    except (subprocess.CalledProcessError, FileNotFoundError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace: {getattr(e, 'stderr', e)}"
    return None
