"""Stand-in host agents for the control-plane tests that run inside a network namespace:
`plane.HostMember`s whose workers are a step count. Prints `hold GEN M0,M1,...` when every live
member holds generation GEN and `leader NAME` when the election's leader changes; reads
`lose N` (host N vanishes: its lease is left to run out) and `stop` on stdin."""

import argparse
import sys
import threading
import time

from recycle_planner.executor.control.election import Election
from recycle_planner.executor.control.plane import HostMember, HostRecord, Keys
from recycle_planner.executor.control.store import EtcdStore, StoreUnavailable


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--hosts", type=int, required=True)
    parser.add_argument("--per-host", type=int, required=True)
    parser.add_argument("--lease", type=float, required=True)
    args = parser.parse_args()
    store, keys = EtcdStore(args.etcd, timeout=2), Keys(args.job)
    members = {}
    for n in range(args.hosts):
        ranks = tuple(range(n * args.per_host, (n + 1) * args.per_host))
        members[n] = HostMember(store, keys, HostRecord(n, f"h{n}", ranks), args.lease,
                                lambda ranks=ranks: {r: 5 for r in ranks})
    gone: set[int] = set()
    stop = threading.Event()

    def report() -> None:
        held, leader = 0, None
        observer = Election(store, keys.election, "observer", args.lease)
        while not stop.wait(0.05):
            live = [m for n, m in members.items() if n not in gone]
            gens = {m.decision.gen if m.decision else 0 for m in live}
            if len(gens) == 1 and min(gens) > held:
                held = min(gens)
                print(f"hold {held} {','.join(map(str, live[0].decision.members))}", flush=True)
            try:
                entry = observer.leader()
            except StoreUnavailable:
                continue
            name = entry.value if entry else None
            if name != leader:
                leader = name
                print(f"leader {name}", flush=True)

    threading.Thread(target=report, daemon=True).start()
    for line in sys.stdin:
        word, *rest = line.split()
        if word == "lose":
            gone.add(int(rest[0]))
            members[int(rest[0])].close(leave=False)
        elif word == "stop":
            break
    stop.set()
    time.sleep(0.1)
    for n, m in members.items():
        if n not in gone:
            m.close()


if __name__ == "__main__":
    main()
