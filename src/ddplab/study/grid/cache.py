"""The grid's cache: each batch size's run groups under ``out``, keyed by what they depend on, refused when a
setting changed rather than mixed (rank 0 owns it under torchrun).
"""

from __future__ import annotations

import json
import os
import shutil

from ddplab.errors import UsageError, literal
from ddplab.serialize import write_json_atomic
from ddplab.study.runs import RunKey, RunResult


class RankZeroCache:
    """A study under torchrun: rank 0 alone reads and writes the cache, and every rank takes its answer."""

    def __init__(self, cache: Cache | None, rank: int):
        self.cache, self.rank = cache, rank

    def load_any(self, global_batch: int, kind: str) -> dict[RunKey, RunResult]:
        import torch.distributed as dist

        found = [self.cache.load_any(global_batch, kind) if self.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        return found[0]

    def save(self, global_batch: int, results: list[RunResult], kind: str) -> None:
        if self.rank == 0:
            self.cache.save(global_batch, results, kind)


class Cache:
    """Finished groups under ``DIR/runs/``, one JSON per batch size, written atomically."""

    def __init__(self, directory: str, fingerprint: str, *, fresh: bool, settings: dict | None = None):
        self.directory, self.fingerprint, self.settings = directory, fingerprint, settings
        self.runs_dir = os.path.join(directory, "runs")
        self.stamp = os.path.join(directory, "config.json")
        if fresh and os.path.isdir(self.runs_dir):
            shutil.rmtree(self.runs_dir)
        # Only runs count: a study that failed before its first group left nothing to protect.
        if self._holds_runs() and self._stamped() not in (None, fingerprint):
            raise UsageError(f"{{out}} {literal(repr(directory))} holds runs of a study with other settings or another "
                             f"spec{self._differences()}; pass {{fresh}} to start over or choose another {{out}}")
        os.makedirs(self.runs_dir, exist_ok=True)

    def _holds_runs(self) -> bool:
        return os.path.isdir(self.runs_dir) and any(name.endswith(".json") for name in os.listdir(self.runs_dir))

    def _stamped(self) -> str | None:
        if not os.path.exists(self.stamp):
            return None
        return self._read(self.stamp).get("fingerprint")

    def _differences(self) -> str:
        """' (FIELD, ...)': the settings that differ from the cached study's, each as its field (the CLI shows
        flags); '' where the cache does not say."""
        old = self._read(self.stamp).get("settings")
        if not isinstance(old, dict) or self.settings is None:
            return ""
        changed = [name for key in sorted(set(old) | set(self.settings))
                   for name in _changed(key, old.get(key), self.settings.get(key))]
        return f" ({', '.join(changed)} changed)" if changed else ""

    def _read(self, path: str):
        try:
            with open(path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            raise UsageError(f"the study cache file {literal(path)} cannot be read (cut short or edited?): pass "
                             "{fresh} to start over") from None

    def _path(self, global_batch: int, kind: str) -> str:
        return os.path.join(self.runs_dir, f"batch-{global_batch}{kind}.json")

    def load_any(self, global_batch: int, kind: str) -> dict[RunKey, RunResult]:
        """Every cached run of one file, by (lr, seed, variant)."""
        path = self._path(global_batch, kind)
        if not os.path.exists(path):
            return {}
        try:
            return {run.key: run for run in map(RunResult.from_json, self._read(path))}
        except (TypeError, KeyError):
            raise UsageError(f"the study cache file {literal(path)} holds no runs ddplab wrote: pass {{fresh}} to "
                             "start over") from None

    def save(self, global_batch: int, results: list[RunResult], kind: str) -> None:
        write_json_atomic(self.stamp, {"fingerprint": self.fingerprint, "settings": self.settings})
        write_json_atomic(self._path(global_batch, kind), [r.to_json() for r in results], standard=False)


def _changed(key: str, old, new) -> list[str]:
    """The fields under ``key`` whose values differ, as error templates."""
    if old == new:
        return []
    if key == "workload":
        return ["the spec file or workload"]
    if key == "target" and isinstance(new, dict):
        return [f"{{target.{new.get('kind')}}}"]
    if isinstance(old, dict) and isinstance(new, dict):
        return [f"{{{key}.{sub}}}" for sub in sorted(set(old) | set(new)) if old.get(sub) != new.get(sub)]
    return [f"{{{key}}}"]
