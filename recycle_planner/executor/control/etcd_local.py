"""A real etcd cluster of one to five members on this machine's loopback: for the tests, the
benchmark and trying the failover without a cluster.

Each member is Debian's `etcd` binary (package `etcd-server`) on its own pair of free ports and
its own data folder; `kill(i)` and `start(i)` take one member away and bring it back (its data
kept, as a member that restarts does), so that a test can lose one member or the quorum.
With `fast` (the tests) timings are tightened (heartbeat 50 ms, election 500 ms) so that a lost
leader is replaced in about a second, and the least lease etcd grants is 1 s; without it etcd
keeps its defaults (100 ms, 1 s), which a loaded machine needs (the benchmark).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from recycle_planner.errors import RecycleError

log = logging.getLogger(__name__)


PROGRESS_NOTIFY = 1.0
"""Seconds between etcd's progress notifications to a quiet watch: well below the clients'
timeout (2 s or more), after which a silent stream is taken as broken and resumed elsewhere."""


def etcd_binary() -> str | None:
    """The `etcd` server on PATH (or /usr/bin, where Debian puts it), None without one."""
    return shutil.which("etcd") or shutil.which("etcd", path="/usr/bin:/usr/sbin")


def etcd_missing() -> str | None:
    """Why a real etcd cannot be used here (no server binary, or no `etcd3gw` client), or
    None. The tests skip with this reason."""
    if etcd_binary() is None:
        return ("etcd is not installed (make test installs Debian's etcd-server where it runs "
                "as root with apt-get)")
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        return "the etcd3gw client is not installed (pip install -e '.[etcd]')"
    return None


def answers(endpoints: str, timeout: float = 1.0, tls=None) -> bool:
    """Whether the etcd at `endpoints` answers a linearizable read now (it has a leader and a
    quorum); `tls`: the client's (`store.EtcdTls`)."""
    from recycle_planner.executor.control.store import EtcdStore, StoreUnavailable

    store = EtcdStore(endpoints, timeout=timeout, tls=tls)
    try:
        store.revision()
        return True
    except StoreUnavailable:
        return False
    finally:
        store.close()


def free_ports(count: int) -> list[int]:
    """`count` distinct ports that are free on 127.0.0.1 now."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class EtcdCluster:
    """`members` etcd processes on loopback; use as a context manager (stopped and their
    folders removed on exit)."""

    def __init__(self, members: int = 3, folder: Path | None = None, quiet: bool = True,
                 fast: bool = True, host: str = "127.0.0.1", wrap: tuple[str, ...] = (),
                 tls: tuple[str, str, Any] | None = None):
        """`host`: the address the members listen on; `wrap`: a command prefix that runs each
        member elsewhere (`ip netns exec NS`: the tests' network namespaces); `tls`: the
        members' certificate and key files and a client's `store.EtcdTls` (whose CA signed
        both): clients then speak TLS and must show a certificate signed by that CA."""
        binary = etcd_binary()
        if binary is None:
            raise RecycleError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.binary = binary
        self.size = members
        self._own_folder = folder is None
        self.folder = Path(folder or tempfile.mkdtemp(prefix="recycle-etcd-"))
        self.folder.mkdir(parents=True, exist_ok=True)
        ports = free_ports(2 * members)
        self.client_ports = ports[:members]
        self.peer_ports = ports[members:]
        self.names = [f"m{i}" for i in range(members)]
        self.procs: list[subprocess.Popen | None] = [None] * members
        self.quiet = quiet
        self.fast = fast
        self.host = host
        self.wrap = tuple(wrap)
        self.tls = tls

    @property
    def endpoints(self) -> str:
        """The client endpoints, as `--etcd` takes them."""
        return ",".join(self._url(i) if self.tls else self.endpoint(i) for i in range(self.size))

    def endpoint(self, i: int) -> str:
        return f"{self.host}:{self.client_ports[i]}"

    def _url(self, i: int) -> str:
        return f"{'https' if self.tls else 'http'}://{self.endpoint(i)}"

    def _tls_flags(self) -> list[str]:
        if self.tls is None:
            return []
        cert, key, client = self.tls
        return ["--cert-file", cert, "--key-file", key, "--client-cert-auth",
                "--trusted-ca-file", client.ca]

    def _command(self, i: int, state: str) -> list[str]:
        h = self.host
        initial = ",".join(f"{n}=http://{h}:{p}" for n, p in zip(self.names, self.peer_ports))
        return [*self.wrap, self.binary, "--name", self.names[i],
                "--data-dir", str(self.folder / self.names[i]),
                "--listen-client-urls", self._url(i), "--advertise-client-urls", self._url(i),
                *self._tls_flags(),
                "--listen-peer-urls", f"http://{h}:{self.peer_ports[i]}",
                "--initial-advertise-peer-urls", f"http://{h}:{self.peer_ports[i]}",
                "--initial-cluster", initial, "--initial-cluster-state", state,
                "--initial-cluster-token", f"recycle-{os.getpid()}-{self.client_ports[0]}",
                *(["--heartbeat-interval", "50", "--election-timeout", "500"] if self.fast
                  else []),
                # a quiet watch hears from its member within a second (`store._EtcdWatch`)
                "--experimental-watch-progress-notify-interval", f"{PROGRESS_NOTIFY:g}s",
                "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m",
                "--log-level", "error" if self.quiet else "info"]

    def start(self, i: int | None = None) -> None:
        """Start member `i` (every member when None)."""
        for j in range(self.size) if i is None else [i]:
            log_file = open(self.folder / f"{self.names[j]}.log", "ab")
            self.procs[j] = subprocess.Popen(self._command(j, "new"), stdout=log_file,
                                             stderr=subprocess.STDOUT, start_new_session=True)
            log_file.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until the cluster answers a linearizable read (it has a leader and a quorum)."""
        deadline = time.monotonic() + timeout
        while not self._answers():
            if time.monotonic() > deadline:
                raise RecycleError(f"etcd did not become ready in {timeout:g} s; logs in "
                                   f"{self.folder}")
            time.sleep(0.1)

    def _answers(self) -> bool:
        if not self.wrap:
            return answers(self.endpoints, tls=self.tls[2] if self.tls else None)
        # elsewhere (a network namespace): ask from there, with this client, not etcdctl
        # (Debian ships it apart from the server, in etcd-client); the client's TLS files go
        # by etcdctl's variables, which `EtcdStore` reads
        probe = ("import sys; from recycle_planner.executor.control.etcd_local import answers; "
                 f"sys.exit(not answers({self.endpoints!r}))")
        return subprocess.run([*self.wrap, sys.executable, "-c", probe], capture_output=True,
                              env={**os.environ, **self._tls_env()}).returncode == 0

    def _tls_env(self) -> dict[str, str]:
        """etcdctl's variables naming this cluster's client TLS files (none without TLS)."""
        from recycle_planner.executor.control.store import EtcdTls

        if self.tls is None:
            return {}
        client = self.tls[2]
        return {name: path for name, path in zip(EtcdTls.ENV, (client.ca, client.cert,
                                                                client.key)) if path}

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Stop member `i` at once (SIGKILL: as if its machine vanished)."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # SIGTERM not heeded in time
                proc.kill()
                proc.wait()
        self.procs[i] = None

    def stop(self) -> None:
        for i in range(self.size):
            self.kill(i, signal.SIGTERM)

    def __enter__(self) -> "EtcdCluster":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)
