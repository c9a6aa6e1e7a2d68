"""What a host's relay and the coordinator's mail carry between them, whatever carries it:
one interface per side, implemented on the coordinator's c10d store.

- `HostTransport`, the host agent's side (`relay.Relay`): push a report, read the two
  bulletins and block until the next notice, read a record, put a direct record between
  workers by its rule, count a rank's incarnations. Every call may block (a cut link): the
  relay makes them on threads of its own (`relay.StoreCalls`, and its notice thread), never
  on its loop.
- `CoordinatorTransport`, the coordinator's side (`mail.RelayMail`): take the reports that
  arrived, publish bulletins and wake the hosts (also as its beat, with nothing changed), post
  a record hosts read by key (a decision), and delete what is no longer needed.

`C10dHost` and `C10dCoordinator` carry it on the coordinator's c10d store (`TCPStore`): the
reports in one queue (`UP_QUEUE`), the bulletins under their keys, a notice key per version
that wakes every host blocked in the store's `wait`, the direct records under their own keys
(see `relay.py` for why each)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol, Sequence

from recycle_planner.executor.control import messages as msg

UP_QUEUE = "relay/up"
"""The coordinator's queue of `HostReport`s."""
GLOBAL_BULLETIN = "relay/all"
"""The bulletin for every host: aborts, decisions, join requests, finish, the outcome."""


def host_bulletin(node: int) -> str:
    """The bulletin for host `node` only: its workers' welcomes and kill notices."""
    return f"relay/host/{node}"


def notice_key(version: int) -> str:
    """Created when the bulletins reach `version`: the key every host waits on."""
    return f"relay/v/{version}"


class HostTransport(Protocol):
    def push(self, report: str) -> None:
        """Hand a `HostReport` (JSON) to the coordinator."""

    def read(self, key: str) -> str | None:
        """The record under `key` (a decision, a direct record), or None."""

    def put_direct(self, message: msg.Message) -> Any:
        """Write a record between workers by its rule (`messages.put`): the count for `count`,
        the winning record for `first`, else None."""

    def next_incarnation(self, rank: int) -> int:
        """The incarnation of `rank` to spawn next (`messages.next_incarnation`)."""

    def bulletins(self, node: int) -> tuple[str, str]:
        """The global bulletin and host `node`'s (JSON), as of one moment."""

    def wait_notice(self, version: int, timeout: float) -> bool:
        """Block until the bulletins reach `version` (True) or `timeout` seconds pass
        (False); a failure raises `RuntimeError` or `OSError`."""


class CoordinatorTransport(Protocol):
    def take(self) -> list[str]:
        """The reports (JSON) that arrived since the last call, in arrival order."""

    def publish(self, version: int, bulletins: Sequence[tuple[str, str]]) -> None:
        """Write `bulletins` (key, JSON), then wake the hosts to `version` (nothing else
        changed: the coordinator's beat)."""

    def post(self, key: str, text: str) -> None:
        """Write a record hosts read by key (a decision)."""

    def delete(self, keys: Sequence[str]) -> None:
        """Remove these keys (direct records of a forgotten iteration)."""

    def delete_prefixed(self, prefixes: tuple[str, ...]) -> None:
        """Remove every key under these prefixes (an old generation's)."""


class C10dHost:
    """A host's side on the coordinator's c10d store: `store` for the calls, `notices` (a
    second client) for the blocking waits, so that a wait never holds up a call."""

    def __init__(self, store: Any, notices: Any):
        self.store, self.notices = store, notices

    def push(self, report: str) -> None:
        self.store.queue_push(UP_QUEUE, report)

    def read(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def put_direct(self, message: msg.Message) -> Any:
        return msg.put(self.store, message)

    def next_incarnation(self, rank: int) -> int:
        return msg.next_incarnation(self.store, rank)

    def bulletins(self, node: int) -> tuple[str, str]:
        everyone, mine = self.notices.multi_get([GLOBAL_BULLETIN, host_bulletin(node)])
        return everyone, mine

    def wait_notice(self, version: int, timeout: float) -> bool:
        import torch.distributed as dist

        try:
            self.notices.wait([notice_key(version)], timedelta(seconds=timeout))
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise
            return False
        return True


class C10dCoordinator:
    """The coordinator's side on its own c10d store."""

    def __init__(self, store: Any):
        self.store = store

    def take(self) -> list[str]:
        return [self.store.queue_pop(UP_QUEUE, False)
                for _ in range(self.store.queue_len(UP_QUEUE))]

    def publish(self, version: int, bulletins: Sequence[tuple[str, str]]) -> None:
        """The bulletins, then the notice key of `version`; the one two versions back leaves
        (a host waits on the next version of the bulletins it read)."""
        self.store.multi_set([k for k, _ in bulletins], [v for _, v in bulletins])
        self.store.set(notice_key(version), "")
        if version >= 2:
            self.store.delete_key(notice_key(version - 2))

    def post(self, key: str, text: str) -> None:
        self.store.set(key, text)

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.store.delete_key(key)

    def delete_prefixed(self, prefixes: tuple[str, ...]) -> None:
        delete_prefixed(self.store, prefixes)


def delete_prefixed(store: Any, prefixes: tuple[str, ...]) -> None:
    """Remove every key of a c10d `store` under these prefixes."""
    if prefixes:
        for key in store.list_keys():
            if key.startswith(prefixes):
                store.delete_key(key)
