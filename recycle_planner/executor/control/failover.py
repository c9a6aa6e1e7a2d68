"""Coordinators that fail over: every coordinator campaigns; the leader makes the decisions
(`plane.Leader`), the others stand by; a deposed leader campaigns again.

`stand_by_or_lead` is the loop a `recycle-planner coordinator --etcd ENDPOINTS` process runs.
`python -m recycle_planner.executor.control.failover --etcd ... --library DIR` runs it as a
process of its own (the tests and the benchmark start several and kill the leader).

Exit status: 0 when stopped (SIGTERM, SIGINT), 3 when the control store is unavailable (every
endpoint down, or etcd lost its quorum): no decision can be made, so the job stops and its
workers write a consistent checkpoint (`--resume` continues).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Callable

from recycle_planner.errors import RecycleError
from recycle_planner.executor.control.election import Deposed, Election
from recycle_planner.executor.control.plane import Keys, Leader, Lookup
from recycle_planner.executor.control.protocol import Decision
from recycle_planner.executor.control.store import ControlStore, StoreUnavailable

log = logging.getLogger(__name__)

STORE_UNAVAILABLE = 3
"""Exit status of a coordinator whose control store cannot answer."""


def stand_by_or_lead(store: ControlStore, keys: Keys, identity: str, ttl: float,
                     pipelines: int, stages: int, lookup: Lookup, stop: threading.Event,
                     on_decision: Callable[[Decision], None] = lambda d: None,
                     on_lead: Callable[[int], None] = lambda revision: None) -> None:
    """Campaign, lead while leading, campaign again when deposed, until `stop` is set.
    Raises `StoreUnavailable` when the store cannot answer."""
    while not stop.is_set():
        election = Election(store, keys.election, identity, ttl)
        try:
            won = election.campaign(stop)
            if won is None:
                break
            on_lead(won.revision)
            Leader(election, keys, pipelines, stages, lookup, on_decision).run(stop)
            if election.deposed.is_set():
                raise election._deposed()
        except Deposed as exc:
            if exc.unreachable:
                raise StoreUnavailable(str(exc)) from None
            log.warning("%s was deposed (%s); campaigning again", identity, exc)
        finally:
            if not election.deposed.is_set():
                election.resign()


def library_lookup(folder: Path) -> tuple[Lookup, int, int]:
    """The plan library's lookup (the plan file and its degradation for a dead set), and the
    job's pipelines and stages."""
    from recycle_planner.library.lookup import PlanLibrary

    lib = PlanLibrary.open(folder)

    def lookup(dead):
        hit = lib.lookup(dead)
        return hit.file.name, hit.entry.metrics.degradation

    return lookup, lib.spec.pipelines, lib.spec.stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recycle_planner.executor.control.failover",
        description="A coordinator that campaigns on etcd and, while it leads, makes the "
                    "job's membership decisions; the others stand by.")
    parser.add_argument("--etcd", required=True, help="etcd endpoints, HOST:PORT[,HOST:PORT]")
    parser.add_argument("--job", default="recycle", help="the job's name (its key prefix)")
    parser.add_argument("--library", required=True, type=Path, help="the plan library folder")
    parser.add_argument("--lease", type=float, default=4.0,
                        help="seconds without renewal after which a leader is replaced")
    parser.add_argument("--name", default=f"{socket.gethostname()}:{os.getpid()}",
                        help="this coordinator's name in the election")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from recycle_planner.executor.control.store import EtcdStore

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        lookup, pipelines, stages = library_lookup(args.library)
        store = EtcdStore(args.etcd, timeout=max(2.0, args.lease))
        stand_by_or_lead(store, Keys(args.job), args.name, args.lease, pipelines, stages,
                         lookup, stop,
                         on_decision=lambda d: print(f"decision {d.gen} {d.action} "
                                                     f"{len(d.members)}", flush=True),
                         on_lead=lambda rev: print(f"leading {rev}", flush=True))
    except StoreUnavailable as exc:
        print(f"error: the control store is unavailable: {exc}", file=sys.stderr)
        return STORE_UNAVAILABLE
    except RecycleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
