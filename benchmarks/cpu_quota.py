"""A fixed CPU quota per process, so that CPU-bound workers sharing one machine behave like
workers with one device each.

The planner models one device per worker: when a peer dies, a survivor gets no faster. On a
shared CPU the survivors of a kill get the dead worker's share of the cores, which hides the
re-routed work. Each process started through `QuotaGroups.wrap` gets its own cgroup (v1, cpu
controller) with a CFS bandwidth quota of `cpus` CPUs over a short period: its speed stays the
same whatever its peers do, as long as the machine has the sum of the quotas to give.

The wrapper is a shell line that makes the group, moves its own pid in and `exec`s the
command, so the process (and every thread and child it starts) runs under the quota from its
first instruction; a restarted process gets a group of its own.

    with QuotaGroups(CpuQuota(0.45)) as groups:
        subprocess.run(groups.wrap([sys.executable, "train.py"]))
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from recycle_planner.errors import RecycleError

log = logging.getLogger(__name__)

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
"""Where the cgroup v1 cpu controller is mounted."""
MIN_QUOTA_US = 1000
"""The kernel refuses a CFS quota or period below 1 ms."""
MAX_PERIOD_US = 1_000_000


@dataclass(frozen=True)
class CpuQuota:
    """`cpus` CPUs per process, enforced every `period_us` (a short period keeps a throttled
    process's pauses short next to the ops it times). `shares` is the weight of all the
    groups together (their parent's cpu.shares) against the machine's other processes (1024:
    like one ordinary process): on a busy machine it must be large enough for the groups to
    get their quotas, or they get less, and more after a peer dies."""

    cpus: float
    period_us: int = 10_000
    shares: int = 1024

    def __post_init__(self) -> None:
        if not MIN_QUOTA_US <= self.period_us <= MAX_PERIOD_US:
            raise RecycleError(f"CPU quota period {self.period_us} us is outside "
                               f"{MIN_QUOTA_US}..{MAX_PERIOD_US}")
        if not self.cpus > 0 or self.quota_us < MIN_QUOTA_US:
            raise RecycleError(f"CPU quota {self.cpus} CPUs over {self.period_us} us is below "
                               f"the kernel's 1 ms: give more CPUs or a longer period")
        if self.shares < 2:
            raise RecycleError(f"cpu.shares {self.shares} must be at least 2")

    @property
    def quota_us(self) -> int:
        return round(self.cpus * self.period_us)

    def settings(self) -> dict[str, int]:
        """A process's group's control files and their values, in the order they are
        written."""
        return {"cpu.cfs_period_us": self.period_us, "cpu.cfs_quota_us": self.quota_us}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CpuQuota":
        return cls(float(data["cpus"]), int(data["period_us"]), int(data["shares"]))


def join_script(quota: CpuQuota) -> str:
    """`sh -c` text run as `sh -c TEXT ROOT COMMAND...`: make ROOT/p<pid>, set the quota, move
    this process in, then become COMMAND."""
    writes = " && ".join(f"echo {value} > \"$d/{name}\""
                         for name, value in quota.settings().items())
    return (f'd="$0/p$$" && mkdir "$d" && {writes} && echo $$ > "$d/cgroup.procs" '
            f'&& exec "$@"')


def wrap_command(command: list[str], root: str | Path, quota: CpuQuota) -> list[str]:
    """`command`, started so that it runs in a cgroup of its own under `root`."""
    return ["sh", "-c", join_script(quota), str(root), *command]


class QuotaGroups:
    """The cgroups of one benchmark: a parent group under the cpu controller made on enter
    (with the quota's shares), a group per process inside it, all removed on exit (a process
    still inside is moved back to the top first)."""

    def __init__(self, quota: CpuQuota, base: str | Path = CGROUP_CPU, name: str | None = None):
        self.quota = quota
        self.base = Path(base)
        self.root = self.base / (name or f"recycle-bench-{os.getpid()}")

    def __enter__(self) -> "QuotaGroups":
        if not (self.base / "cpu.cfs_quota_us").is_file():
            raise RecycleError(f"no cgroup v1 cpu controller at {self.base} (no "
                               f"cpu.cfs_quota_us): CPU quotas need it")
        try:
            self.root.mkdir()
        except OSError as exc:
            raise RecycleError(f"cannot create the cgroup {self.root} ({exc.strerror}): CPU "
                               f"quotas need root and a writable cgroup v1 cpu controller"
                               ) from None
        try:
            (self.root / "cpu.shares").write_text(str(self.quota.shares))
        except OSError as exc:
            self.root.rmdir()
            raise RecycleError(f"cannot set cpu.shares {self.quota.shares} on {self.root} "
                               f"({exc.strerror})") from None
        log.info("CPU quota: %s CPUs per process every %d us, groups under %s (cpu.shares %d)",
                 self.quota.cpus, self.quota.period_us, self.root, self.quota.shares)
        return self

    def wrap(self, command: list[str]) -> list[str]:
        return wrap_command(command, self.root, self.quota)

    def __exit__(self, *exc) -> None:
        top = self.base / "cgroup.procs"
        for group in sorted(self.root.glob("p*")):
            try:
                for pid in (group / "cgroup.procs").read_text().split():
                    top.write_text(pid)
                group.rmdir()
            except OSError as err:
                log.warning("could not remove the cgroup %s: %s", group, err.strerror)
        try:
            self.root.rmdir()
        except OSError as err:
            log.warning("could not remove the cgroup %s: %s", self.root, err.strerror)
