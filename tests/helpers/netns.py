"""Hosts made from network namespaces, for the cluster tests.

`Hosts(n)` makes a namespace for the coordinator holding a bridge (10.231.0.1/24) and n host
namespaces, each joined to the bridge by a veth pair whose host end is `eth0`
(10.231.0.10+i). Processes run inside with `ip netns exec`. Everything is removed on exit
(every process left in a namespace is SIGKILLed first). Addresses exist only inside these
namespaces, so parallel tests may reuse them."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid

IP = shutil.which("ip") or "/usr/sbin/ip"
SUBNET = "10.231.0"
COORD_ADDR = f"{SUBNET}.1"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists(IP):
        return "iproute2 ('ip') is not installed"
    probe = f"rcp-probe-{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' fails: {made.stderr.strip()}"
    try:
        pair = _ip("-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb",
                   check=False)
        if pair.returncode != 0:
            return f"cannot make a veth pair: {pair.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    def __init__(self, n: int):
        tag = uuid.uuid4().hex[:6]
        self.coord = f"rcp-{tag}-c"
        self.hosts = [f"rcp-{tag}-h{i}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Hosts":
        try:
            _ip("netns", "add", self.coord)
            _ip("-n", self.coord, "link", "set", "lo", "up")
            _ip("-n", self.coord, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.coord, "addr", "add", f"{COORD_ADDR}/24", "dev", "br0")
            _ip("-n", self.coord, "link", "set", "br0", "up")
            for i, ns in enumerate(self.hosts):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.coord, "link", "add", f"vh{i}", "type", "veth", "peer", "name",
                    "eth0", "netns", ns)
                _ip("-n", self.coord, "link", "set", f"vh{i}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}.{10 + i}"

    def popen(self, ns: str, cmd: list[str], log, env: dict | None = None) -> subprocess.Popen:
        proc = subprocess.Popen([IP, "netns", "exec", ns, *cmd], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def pids(self, ns: str) -> list[int]:
        out = _ip("netns", "pids", ns, check=False).stdout.split()
        return [int(p) for p in out]

    def signal(self, ns: str, sig: int) -> None:
        for pid in self.pids(ns):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def __exit__(self, *exc) -> None:
        for ns in [*self.hosts, self.coord]:
            for _ in range(50):  # bounded: killing may reveal children that were starting
                if not self.pids(ns):
                    break
                self.signal(ns, signal.SIGKILL)
                time.sleep(0.05)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in [*self.hosts, self.coord]:
            _ip("netns", "del", ns, check=False)
