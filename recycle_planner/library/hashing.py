"""Fingerprints that decide whether a library entry is still good: the job's (spec and policy),
the settings', and each plan file's SHA-256."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from recycle_planner.job.policy import Policy
from recycle_planner.job.spec import JobSpec


def digest(data: Any) -> str:
    """16 hex digits of the SHA-256 of `data` as canonical JSON."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def spec_hash(spec: JobSpec, policy: Policy) -> str:
    return digest({"spec": spec.to_dict(), "policy": policy.to_dict()})


def file_sha256(path: Path) -> str | None:
    """The file's SHA-256, or None if it cannot be read."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()
