"""What boundary shapes that vary with the data cost: the runtime's bookkeeping per message, and
the small GPT's step time with fixed and varying sequence lengths.

Usage: python benchmarks/bench_shapes.py [--iterations N] [--repeat N] [--json FILE]

1. Per message, in one process: `StageRuntime._post` and `_send` (layout, buffer, packing; the
   communication replaced by a no-op) for a GPT activation of 8 x 64 x 64 float32, with a fixed
   layout and with a symbolic one resolved from `DynamicDims` for every message (the least of
   5 alternating rounds' medians).
2. End to end: examples/gpt_small.py on 2 stages x 2 pipelines x 8 micro-batches (local gloo
   processes, default policy, one library planned for the longest sequence) with a fixed length
   of 64, lengths drawn from 32..64 per iteration and per micro-batch, and a fixed 48 (the
   draws' mean), for the same data path without the dynamic bookkeeping. Median step time from
   iteration 5 on, median of the runs (the configurations interleaved); tokens per second =
   D*M*8*mean length / step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import machine

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from bench_executor import D, M, S, median_step  # noqa: E402

from recycle_planner.executor import LaunchConfig, launch, load_job  # noqa: E402
from recycle_planner.io import write_json  # noqa: E402
from recycle_planner.job.policy import Policy  # noqa: E402
from recycle_planner.executor.profile import profile_job  # noqa: E402
from recycle_planner.job.profiler import write_spec  # noqa: E402
from recycle_planner.library import Settings, build_library  # noqa: E402

GPT = f"{ROOT / 'examples' / 'gpt_small.py'}:make_job"
BASE = ["--dtype", "float32", "--clip", "0", "--warmup", "0"]
ROUNDS = 5
"""Per-message timing: the least of this many rounds' medians (the load varies meanwhile)."""
CONFIGS = {  # label -> job arguments
    "fixed 64": ["--seq", "64"],
    "32..64 per iteration": ["--seq", "64", "--min-seq", "32"],
    "32..64 per micro-batch": ["--seq", "64", "--min-seq", "32", "--vary", "microbatch"],
    "fixed 48": ["--seq", "48"],
}


class _NoComm:
    """Stands for `Comm`: every operation returns at once."""

    def irecv(self, buf, src, tag):
        return None

    def isend(self, buf, dst, tag):
        return None

    def sent(self, work):
        return True


def per_message(repeats: int = 20000) -> dict:
    """Microseconds per `_post` + `_send` pair of an 8 x 64 x 64 float32 message, with a fixed
    layout and with a symbolic one whose sizes come from `DynamicDims` for every micro-batch
    (always 64, so that both copy the same bytes; one thread)."""
    import torch

    from recycle_planner.executor.data.boundary import layout_of
    from recycle_planner.executor.data.runtime import Instr, StageRuntime
    from recycle_planner.executor.data.shapes import DynamicDims
    from recycle_planner.executor.data.state import StageState

    torch.set_num_threads(1)
    fixed = layout_of(torch.zeros(8, 64, 64))
    dynamic = fixed._replace(leaves=(fixed.leaves[0]._replace(shape=(8, "seq", 64)),),
                             nbytes=0, dynamic=True)
    dims = DynamicDims({"seq": 64}, lambda iteration, pipeline, microbatch: {"seq": 64})
    leaves = [torch.zeros(8, 64, 64)]
    runtimes = {}
    for label, layout in (("fixed", fixed), ("dynamic", dynamic)):
        runtimes[label] = StageRuntime(StageState(torch.nn.Linear(1, 1), None), None, None, 1,
                                       3, D, M, torch.device("cpu"), layout, layout, dims=dims)
        runtimes[label].comm = _NoComm()
    rounds: dict[str, list[float]] = {label: [] for label in runtimes}
    step = 0
    for _ in range(ROUNDS):  # alternate, so that both see the shared machine's load alike
        for label, runtime in runtimes.items():
            times = []
            for r in range(repeats // ROUNDS):
                step += 1
                it, mb = step // M, step % M  # a new micro-batch each time: sizes looked up
                ins = Instr("F", 0, mb, 0, (1, 2), 1, (3, 4), "F0")
                t0 = time.perf_counter()
                runtime._post(ins, 0, it)
                runtime._send(leaves, ins, 0, it)
                times.append(time.perf_counter() - t0)
                runtime.posted.clear()
            rounds[label].append(statistics.median(times))
    return {label: 1e6 * min(medians) for label, medians in rounds.items()}


def end_to_end(iterations: int, repeat: int, work: Path) -> dict:
    args = BASE + ["--iterations", str(iterations)]
    spec, _ = profile_job(load_job(GPT, args + CONFIGS["fixed 64"]), D, M, name="gpt-shapes")
    write_spec(spec, work / "gpt.toml")
    lib = work / "lib"
    build_library(spec, Policy(), 1, lib, Settings(solver="heuristic"), jobs=1)
    steps: dict[str, list[float]] = {label: [] for label in CONFIGS}
    for r in range(repeat):  # configurations interleaved: the shared machine's load drifts
        for label, more in CONFIGS.items():
            res = launch(GPT, LaunchConfig(nproc=D * S, run_dir=str(work / f"run-{r}")),
                         args + more + ["--library", str(lib)])
            steps[label].append(median_step(res.iteration_end, 5))
    out = {}
    for label, more in CONFIGS.items():
        job = load_job(GPT, args + more)
        mean = statistics.mean(job.data(i, p, m)[0].shape[1] for i in range(5, iterations)
                               for p in range(D) for m in range(M))
        step = statistics.median(steps[label])
        out[label] = {"step_ms": step, "runs": steps[label], "mean_length": mean,
                      "tokens_per_s": D * M * 8 * mean / (step / 1e3)}
    return out


def markdown(results: dict) -> str:
    msg = results["per_message_us"]
    lines = [f"Per message (`_post` + `_send`, no communication): fixed layout "
             f"{msg['fixed']:.1f} us, dynamic {msg['dynamic']:.1f} us.", "",
             "| sequence length | mean length | step time (ms) | tokens/s |",
             "| --- | ---: | ---: | ---: |"]
    for label, row in results["gpt"].items():
        lines.append(f"| {label} | {row['mean_length']:.1f} | {row['step_ms']:.1f} | "
                     f"{row['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=25)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = {"machine": machine(), "grid": f"{S} stages x {D} pipelines x {M} micro-batches",
               "iterations": args.iterations, "repeat": args.repeat,
               "per_message_us": per_message()}
    with tempfile.TemporaryDirectory(prefix="bench-shapes-") as tmp:
        results["gpt"] = end_to_end(args.iterations, args.repeat, Path(tmp))
    if args.json:
        write_json(args.json, results)
    print(f"machine: {results['machine']}; {results['grid']}; {args.repeat} run(s) each")
    print(markdown(results))


if __name__ == "__main__":
    main()
