"""Several nodes on one machine: Linux network namespaces joined by rate-limited links.

[Note: a node lab]
A cluster's nodes talk to each other over a network much slower than the memory inside a node. On one
machine, as root, each node can be a network namespace (its own interfaces, routes and loopback): the
lab makes one namespace per node and a hub namespace holding a bridge (the switch), and joins each
node to the hub by a veth pair. Each node's end carries an address from the loopback range
(``127.77.0.<node + 1>/24``; ``route_localnet`` lets the kernel route it off ``lo``), so nothing the lab
does can reach beyond the machine, and the names and addresses exist only inside namespaces the lab
created. ``tc``'s token bucket filter (``tbf``) gives every veth end the link's rate, so each node
sends and receives at most ``rate_mbit`` over the network: a node's NIC. Traffic between processes of
one node stays on that namespace's loopback at memory speed, as between the GPUs of a node; gloo
sends over the interface named by ``GLOO_SOCKET_IFNAME`` (set by :meth:`NodeLab.env`).

The bytes that crossed the network are the kernel's counters of each node's veth
(``/sys/class/net/<dev>/statistics``, read inside the node): frames with their TCP/IP headers, as
a NIC counts them. A process runs on a node either as a command (:meth:`NodeLab.popen`: ``ip netns
exec``, e.g. one ``torchrun`` agent per node) or by moving itself into the node's namespace before it
opens a socket (:meth:`NodeLab.enter`, used by ``run_distributed(..., lab=...)``).

Everything is torn down on the way out (the ``with`` block's end, an exception, ``KeyboardInterrupt``,
SIGTERM or interpreter exit): the processes the lab started are killed, then its namespaces are
deleted, which deletes their links. Each lab's names carry the creating process's id and a random
tag, so labs of concurrent runs never collide. Without root or the ``ip``/``tc`` tools (package
``iproute2``) :func:`unavailable` says why, and tests that need a lab skip with that reason.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import threading
from pathlib import Path
from typing import Sequence

__all__ = ["NodeLab", "unavailable"]

ADDRESS_PREFIX = "127.77.0"  # node i is 127.77.0.(i + 1)/24: loopback range, inside the lab's namespaces only
_CLONE_NEWNET = 0x40000000  # <linux/sched.h>
_IP_TIMEOUT_S = 20  # one ip/tc command; they take milliseconds


def unavailable() -> str | None:
    """Why a node lab cannot be built here (no root, no ``ip``/``tc``, namespaces refused), or None."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "a node lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "a node lab needs root (it creates network namespaces and sets tc rate limits)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"a node lab needs the {' and '.join(missing)} tool(s): install iproute2 (apt-get install iproute2)"
    probe = f"fsdplab-probe-{os.getpid()}-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if made.returncode != 0:
        return f"network namespaces are refused here: ip netns add: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=_IP_TIMEOUT_S)
    return None


class NodeLab:
    """``nodes`` network namespaces, each joined to a switch by a link of ``rate_mbit`` Mbit/s each way
    ([Note: a node lab]). Use as a context manager; everything it made is gone when the block ends."""

    def __init__(self, nodes: int, rate_mbit: float, *, mtu: int = 9000) -> None:
        if nodes < 1:
            raise ValueError(f"a node lab needs at least one node, got nodes={nodes}")
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit={rate_mbit} must be a positive link rate in Mbit/s")
        self.nodes = nodes  # number of node namespaces
        self.rate_mbit = rate_mbit  # each node's link rate, each direction
        self.mtu = mtu  # link MTU in bytes (9000: jumbo frames, as data-center networks use)
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"  # unique per lab; device names stay <= 15 chars
        self.hub = f"fsdplab-{tag}-hub"  # the switch's namespace
        self.namespaces = [f"fsdplab-{tag}-n{i}" for i in range(nodes)]  # node i's namespace
        self.devices = [f"fl{tag}n{i}" for i in range(nodes)]  # node i's veth end, inside node i
        self._hub_ports = [f"fl{tag}h{i}" for i in range(nodes)]  # its peer on the switch
        self._made: list[str] = []  # namespaces created so far, deleted in reverse on teardown
        self._procs: list[subprocess.Popen] = []  # processes started on nodes, killed on teardown
        self._lock = threading.Lock()
        self._closed = False
        self._previous_sigterm = None

    # -- setup and teardown ------------------------------------------------------------------------

    def __enter__(self) -> "NodeLab":
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            # SIGTERM would end the process without unwinding: make it unwind, so the ``with`` block's exit runs
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        self._add_namespace(self.hub)
        self._ip(self.hub, "link", "add", "br0", "type", "bridge")
        self._ip(self.hub, "link", "set", "br0", "up")
        for i, (ns, dev, port) in enumerate(zip(self.namespaces, self.devices, self._hub_ports)):
            self._add_namespace(ns)
            self._ip(None, "link", "add", dev, "mtu", str(self.mtu), "netns", ns, "type", "veth",
                     "peer", "name", port, "mtu", str(self.mtu), "netns", self.hub)
            self._ip(self.hub, "link", "set", port, "master", "br0")
            self._ip(self.hub, "link", "set", port, "up")
            for name in ("all", "default", dev):
                self._exec(ns, "sh", "-c", f"echo 1 > /proc/sys/net/ipv4/conf/{name}/route_localnet")
            self._ip(ns, "addr", "add", f"{self.address(i)}/24", "dev", dev)
            self._ip(ns, "link", "set", "lo", "up")
            self._ip(ns, "link", "set", dev, "up")
        self._shape("add")

    def _shape(self, verb: str) -> None:
        """``tc qdisc <verb>`` a token bucket of ``rate_mbit`` on both ends of every link: each node's uplink
        and downlink."""
        burst = max(64 * 1024, 4 * self.mtu, int(self.rate_mbit * 1e6 / 8 / 100))  # >= 10 ms of traffic
        for ns, dev, port in zip(self.namespaces, self.devices, self._hub_ports):
            for where, link in ((ns, dev), (self.hub, port)):
                self._exec(where, "tc", "qdisc", verb, "dev", link, "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                           "burst", str(burst), "latency", "50ms")

    def set_rate(self, rate_mbit: float) -> None:
        """Change every link's rate now (from any process, a rank inside a node too: root runs ``tc``)."""
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit={rate_mbit} must be a positive link rate in Mbit/s")
        self.rate_mbit = rate_mbit
        self._shape("change")

    def close(self) -> None:
        """Kill the processes started on the nodes, then delete every namespace (and so every link).
        Safe to call more than once and from any exit path."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: the agent and the ranks it started
                except ProcessLookupError:
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            for pid in _pids_in(ns):  # anything a process of ours left running inside it
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_IP_TIMEOUT_S)
        self._made.clear()
        atexit.unregister(self.close)
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _add_namespace(self, ns: str) -> None:
        self._ip(None, "netns", "add", ns)
        self._made.append(ns)

    def _ip(self, ns: str | None, *args: str) -> None:
        self._exec(ns, "ip", *args)

    def _exec(self, ns: str | None, *argv: str) -> None:
        cmd = list(argv) if ns is None else ["ip", "netns", "exec", ns, *argv]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"node lab setup failed: {' '.join(cmd)}: {done.stderr.strip()}")

    # -- using the nodes ---------------------------------------------------------------------------

    def address(self, node: int) -> str:
        """Node ``node``'s address on the network (its veth end), e.g. for a rendezvous endpoint."""
        return f"{ADDRESS_PREFIX}.{node + 1}"

    def env(self, node: int) -> dict[str, str]:
        """Environment for processes on ``node``: gloo sends over the node's link."""
        return {"GLOO_SOCKET_IFNAME": self.devices[node]}

    def popen(self, node: int, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace in a session of its own (killed, with its children, on
        teardown). ``env`` is added to this process's environment and :meth:`env`."""
        full_env = {**os.environ, **self.env(node), **(env or {})}
        proc = subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *argv], env=full_env,
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def enter(self, node: int) -> None:
        """Move the calling process into ``node``'s namespace and set :meth:`env`. Call it first thing in a
        fresh, single-threaded process (a spawned rank), before any socket or thread: a namespace change
        applies to the calling thread only."""
        fd = os.open(f"/var/run/netns/{self.namespaces[node]}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.namespaces[node]}")
        finally:
            os.close(fd)
        os.environ.update(self.env(node))

    def counters(self) -> list[tuple[int, int]]:
        """(bytes sent, bytes received) by each node's link so far, frames with headers, as the kernel counts."""
        out = []
        for ns, dev in zip(self.namespaces, self.devices):
            read = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes",
                                   f"/sys/class/net/{dev}/statistics/rx_bytes"],
                                  capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=True)
            tx, rx = (int(v) for v in read.stdout.split())
            out.append((tx, rx))
        return out

    def sent_from_here(self, node: int) -> int:
        """Bytes ``node``'s link has sent so far, read by a process inside that node (:meth:`enter`): the
        kernel's counter of the device, through ``/proc/self/net/dev``, which shows the reader's namespace."""
        for line in Path("/proc/self/net/dev").read_text().splitlines()[2:]:
            name, _, fields = line.partition(":")
            if name.strip() == self.devices[node]:
                return int(fields.split()[8])  # receive: bytes packets errs drop fifo frame compressed multicast
        raise RuntimeError(f"{self.devices[node]} is not in this process's network namespace: call enter({node}) first")

    def bytes_sent(self) -> int:
        """Bytes all nodes sent onto the network so far (each byte between nodes counted once)."""
        return sum(tx for tx, _ in self.counters())

    def __getstate__(self) -> dict:
        """What a spawned rank needs (:meth:`enter`, :meth:`env`, :meth:`address`); not the processes or the lock."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_procs", "_lock", "_previous_sigterm", "_made")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _procs=[], _lock=threading.Lock(), _previous_sigterm=None, _made=[],
                             _closed=True)  # a copy in another process owns nothing: its close() does nothing


def _pids_in(ns: str) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    return [int(p) for p in listed.stdout.split()] if listed.returncode == 0 else []


def _raise_system_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)
