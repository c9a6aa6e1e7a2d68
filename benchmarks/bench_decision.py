"""The size of a generation's `Decision` on the wire and the time to encode and decode it.

Every survivor decodes the decision of each generation change (`Decision.from_json`: a worker
behind its host agent's relay, `link.HostLink.decision`), the coordinator's store sends it
once per host, and on etcd it is stored deflated (`plane.encode_decision`) and sent to every
host's watch. Measured here, alone in this process, for the decisions of a job of
`--ranks` ranks in 8 stages (pipeline-major ranks, hosts of `--per-host` consecutive ranks):

- `initial`: generation 1, every rank a member, every non-first worker of a stage receiving
  its parameters from the first (`sources` for all but one rank per stage);
- `host lost`: the last host's ranks are gone, the others keep their state (incarnation 0);
- `host back`: the lost host's ranks restarted (incarnation 1, no state: a source each).

    python bench_decision.py                      # 1,024 and 8,192 ranks
    python bench_decision.py --ranks 8192 --per-host 64
"""

from __future__ import annotations

import argparse
import json
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import machine  # noqa: E402

from recycle_planner.executor.control import protocol  # noqa: E402
from recycle_planner.executor.control.plane import decode_decision, encode_decision  # noqa: E402

STAGES = 8
RESULTS = Path(__file__).resolve().parent / "results" / "decision.json"


def decisions(ranks: int, per_host: int) -> dict[str, protocol.Decision]:
    """The three decisions of the module's docstring."""
    def lookup(dead):
        return ("plan.json.gz", 0.1)
    pipelines = ranks // STAGES
    lost = set(range(ranks - per_host, ranks))
    every = {r: 0 for r in range(ranks)}
    return {
        "initial": protocol.decide(1, pipelines, STAGES, dict.fromkeys(every, 0), lookup,
                                   initial=True, incarnations=every),
        "host lost": protocol.decide(2, pipelines, STAGES,
                                     {r: 7 for r in every if r not in lost}, lookup,
                                     incarnations=every),
        "host back": protocol.decide(3, pipelines, STAGES,
                                     {r: None if r in lost else 7 for r in every}, lookup,
                                     incarnations={**every, **dict.fromkeys(lost, 1)}),
    }


def best(fn, repeat: int = 5) -> float:
    """The least time of one call, in seconds (the least of `repeat` timings of a few calls
    each)."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return min(timer.repeat(repeat, number)) / number


def measure(ranks: int, per_host: int) -> list[dict]:
    rows = []
    for name, decision in decisions(ranks, per_host).items():
        text = decision.to_json()
        stored = encode_decision(decision)
        assert protocol.Decision.from_json(text) == decision
        rows.append({
            "ranks": ranks, "per_host": per_host, "decision": name,
            "members": len(decision.members), "sources": len(decision.sources),
            "json_bytes": len(text.encode()), "stored_bytes": len(stored),
            "encode_ms": 1e3 * best(decision.to_json),
            "decode_ms": 1e3 * best(lambda: protocol.Decision.from_json(text)),
            "stored_encode_ms": 1e3 * best(lambda: encode_decision(decision)),
            "stored_decode_ms": 1e3 * best(lambda: decode_decision.__wrapped__(stored))})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--per-host", type=int, default=None,
                        help="ranks per host (default: 8 up to 1,024 ranks, 64 above, as "
                             "bench_relay.py --recovery runs them)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for ranks in args.ranks:
        per_host = args.per_host or (8 if ranks <= 1024 else 64)
        if ranks % STAGES or ranks % per_host:
            sys.exit(f"--ranks {ranks}: must be a multiple of {STAGES} stages and of "
                     f"--per-host {per_host}")
        for row in measure(ranks, per_host):
            print(json.dumps(row), flush=True)
            rows.append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
