"""A run folder belongs to one run: its record (`run.json`), its lock, its logs per attempt and
the losses of every iteration it trained.

A launcher (or coordinator) claims the folder before any process starts (`claim`):

- a folder with no run in it starts a new run (a fresh run id, attempt 1);
- `--resume` continues the run whose record is there (same run id, the next attempt) from
  its newest complete checkpoint; with no checkpoint there is nothing to resume, which is
  said at once, not after the workers' start-up;
- a folder holding another run's checkpoints is refused in one line unless `--resume`
  (continue it) or `--start-over` (remove that run's checkpoints, losses and result, said in
  the log, and start a new run) is given: a new run never writes beside an old run's
  checkpoints, where a checkpoint of the same iteration would be taken for its own.

While the run lives it holds `RUN/.run.lock` (flock: the kernel releases it when the holder
dies), so that a second launcher on the same folder is refused in one line too.

Each attempt writes its processes' logs into `logs/attempt-N/`, so a resumed run never
overwrites the failed attempt's logs. The launcher appends each iteration's loss and end time
to `losses.jsonl` as soon as they are final (`LossRow`; a killed coordinator writes no
result.json), and the result of a resumed or taken-over run takes the iterations before its
own start from there.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from recycle_planner.errors import RecycleError
from recycle_planner.io import write_json

log = logging.getLogger(__name__)

RUN_RECORD = "run.json"
RUN_LOCK = ".run.lock"
LOSSES = "losses.jsonl"
CHECKPOINTS = "checkpoints"
RESULT = "result.json"
VERSION = 1


@dataclass(frozen=True)
class RunRecord:
    """`run.json`: which run the folder holds and which attempt of it is (or was last)
    running; `chain`: the attempt that started or resumed the run, which this one continues
    through coordinators that took over one from another (itself if it did not take over).
    Their attempts' loss rows are one generation's, whoever of them wrote them."""

    run_id: str
    attempt: int
    started: float
    chain: int = 0
    version: int = VERSION

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict, where: Path) -> "RunRecord":
        try:
            attempt = int(data["attempt"])
            return cls(str(data["run_id"]), attempt, float(data["started"]),
                       int(data.get("chain", attempt)), int(data.get("version", VERSION)))
        except (KeyError, TypeError, ValueError) as exc:
            raise RecycleError(f"{where}: not a run record ({exc})") from None

    def taken_over(self) -> range:
        """The attempts this one took over from, directly or through others (empty when it
        started or resumed the run)."""
        return range(self.chain, self.attempt)

    def log_dir(self, run_dir: str | Path) -> Path:
        return Path(run_dir) / "logs" / f"attempt-{self.attempt}"


def read_record(run_dir: str | Path) -> RunRecord | None:
    path = Path(run_dir) / RUN_RECORD
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise RecycleError(f"{path}: unreadable run record ({exc})") from None
    if not isinstance(data, dict):
        raise RecycleError(f"{path}: not a run record")
    return RunRecord.from_json(data, path)


def _checkpoints(run_dir: Path) -> list[str]:
    folder = run_dir / CHECKPOINTS
    return sorted(p.name for p in folder.glob("iter-*")) if folder.is_dir() else []


class RunFolder:
    """The claimed folder: its record and its lock (held until `release`)."""

    def __init__(self, run_dir: Path, record: RunRecord, fd: int):
        self.run_dir = run_dir
        self.record = record
        self._fd: int | None = fd

    @property
    def log_dir(self) -> Path:
        return self.record.log_dir(self.run_dir)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def add_losses(self, rows: list[LossRow]) -> None:
        append_losses(self.run_dir, [r.to_json() for r in rows])

    def saved_rows(self) -> dict[int, LossRow]:
        """Every iteration written by this run's attempts so far (see `read_rows`)."""
        return read_rows(self.run_dir)

    def saved_losses(self) -> dict[int, float]:
        """Every iteration's loss written by this run's attempts so far (the latest wins)."""
        return read_losses(self.run_dir)


@dataclass(frozen=True)
class LossRow:
    """One line of `losses.jsonl`: iteration `iteration`'s mean loss over its D*M
    micro-batches, the generation and attempt that made it final, and when it ended
    everywhere (`end`: wall-clock seconds, the latest rank's report; None where the writer
    did not know it, as a last-stage worker that lost its coordinator)."""

    iteration: int
    loss: float
    gen: int | None = None
    attempt: int | None = None
    end: float | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "LossRow":
        gen, attempt, end = data.get("gen"), data.get("attempt"), data.get("end")
        return cls(int(data["iteration"]), float(data["loss"]),
                   None if gen is None else int(gen), None if attempt is None else int(attempt),
                   None if end is None else float(end))


def append_losses(run_dir: str | Path, rows: list[dict]) -> None:
    """Append iterations' rows (`LossRow.to_json()`; a worker's may lack `end`) to
    losses.jsonl (by the launcher as they become final; by last-stage workers that lost the
    control plane). A line a crash cut short is ended first, so that the next row is not
    glued onto it (a coordinator taking over appends after its lost predecessor)."""
    if rows:
        with open(Path(run_dir) / LOSSES, "a+b") as out:
            torn = out.tell() > 0 and (out.seek(-1, os.SEEK_END), out.read(1))[1] != b"\n"
            out.write(((b"\n" if torn else b"")
                       + "".join(json.dumps(r, separators=(",", ":")) + "\n"
                                 for r in rows).encode()))
            out.flush()
            os.fsync(out.fileno())


def read_rows(run_dir: str | Path) -> dict[int, LossRow]:
    """Each iteration's row in losses.jsonl: the latest wins, except that a row without an
    end keeps the end an earlier row of that iteration gave (an iteration is saved once it is
    final, so every row of it is of the same iteration's run)."""
    path = Path(run_dir) / LOSSES
    rows: dict[int, LossRow] = {}
    if not path.is_file():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = LossRow.from_json(json.loads(line))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # a line cut short by a crash
        before = rows.get(row.iteration)
        if row.end is None and before is not None and before.end is not None:
            row = replace(row, end=before.end)
        rows[row.iteration] = row
    return rows


def read_losses(run_dir: str | Path) -> dict[int, float]:
    """Each iteration's loss in losses.jsonl (the latest row wins)."""
    return {i: row.loss for i, row in read_rows(run_dir).items()}


def claim(run_dir: str | Path, resume: bool, start_over: bool,
          take_over: bool = False, wait: float = 0.0) -> RunFolder:
    """Take the folder for this run (see the module's docstring); a `RecycleError` in one line
    if it holds another run, is in use, or has nothing to resume. `take_over`: a coordinator
    that takes over from a lost one continues its run as the next attempt (its logs apart),
    whether or not a checkpoint exists yet. `wait`: seconds to wait for a process that still
    holds the folder (a deposed coordinator whose link was cut lives until it finds out)."""
    from recycle_planner.executor.data.state import latest_checkpoint

    if resume and start_over:
        raise RecycleError("--resume continues the run in the folder and --start-over "
                           "discards it: give one")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = _lock(run_dir, wait)
    try:
        previous = read_record(run_dir)
        checkpoints = _checkpoints(run_dir)
        if take_over:
            if previous is None:
                raise RecycleError(f"--take-over: {run_dir} holds no run to take over")
            record = RunRecord(previous.run_id, previous.attempt + 1, time.time(),
                               previous.chain)
        elif resume:
            if latest_checkpoint(run_dir) is None:
                raise RecycleError(f"--resume: no complete checkpoint in "
                                   f"{run_dir / CHECKPOINTS} to resume from")
            attempt = previous.attempt + 1 if previous else 1
            record = RunRecord(previous.run_id if previous else _new_id(), attempt,
                               time.time(), attempt)
        else:
            who = f"run {previous.run_id}" if previous else "an earlier run"
            if checkpoints and not start_over:
                raise RecycleError(
                    f"{run_dir} holds {who}'s checkpoints (the newest {checkpoints[-1]}): "
                    f"continue it with --resume, start over with --start-over (removes them), "
                    f"or choose another --run-dir")
            _discard(run_dir, who, said=bool(checkpoints))
            attempt = previous.attempt + 1 if previous else 1
            record = RunRecord(_new_id(), attempt, time.time(), attempt)
        write_json(run_dir / RUN_RECORD, record.to_json())
        record.log_dir(run_dir).mkdir(parents=True, exist_ok=True)
    except BaseException:
        os.close(fd)
        raise
    return RunFolder(run_dir, record, fd)


def _new_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]


def _discard(run_dir: Path, who: str, said: bool) -> None:
    """A new run: the earlier run's checkpoints (only with --start-over, and `said` in the
    log), losses and result go; its logs stay, under their own attempt folders."""
    for name in (CHECKPOINTS, LOSSES, RESULT):
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    if said:
        log.warning("--start-over: removed %s's checkpoints, losses and result from %s", who,
                    run_dir)


def _lock(run_dir: Path, wait: float = 0.0) -> int:
    """The run folder's lock; held by another process, waited for up to `wait` seconds."""
    path = run_dir / RUN_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    deadline = time.monotonic() + wait
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip()
        os.close(fd)
        raise RecycleError(f"{run_dir} is in use by another run ({holder or 'a process'}): "
                           f"wait for it to end, or choose another --run-dir") from None
    except OSError as exc:
        os.close(fd)
        raise RecycleError(f"{path}: cannot lock the run folder: {exc}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode())
    return fd
