"""What each rank's put-back slice kept of its gradient, judged across ranks (pure: no torch).

Each rank recorded, at a cat of every rank's gathered features where only its own slice carries a gradient
(:mod:`.gathers`), a few elements of what every slice received. Slice s's full gradient is what the W ranks' losses
sent it, Σ_r received_r[s]; rank s kept received_s[s]. DDP averages the kept parts, so against a gather with
autograd (which sums every rank's share back) the parameters behind slice s get kept / full of their gradient:
1/W at every element when every rank computes the same loss, a mix when the ranks' losses differ (a local loss).
"""

from __future__ import annotations

import math
from typing import Any

SHARE_TOLERANCE = 1e-3  # relative: float32 gradients summed in another order
SAME_DIRECTION = 1e-6  # within this of 1, a cosine says the kept part is a scale of the whole
NEGLIGIBLE = 1e-6  # an element whose full gradient is below this fraction of the largest carries no share


def judge(records: list[dict[str, Any]]) -> tuple[str, str, str | None] | None:
    """(finding code, detail, a fix of its own or None) of the first complete gather of the run; None where nothing
    was seen, or nothing dropped."""
    for entries in _groups(records):
        shares = _shares(entries)
        if not shares:
            continue
        size = len(entries)
        first = entries[0]
        norm, cosine = _kept_against_full(entries)
        one_share = all(math.isclose(share, 1 / size, rel_tol=SHARE_TOLERANCE) for share in shares)
        # A few elements' rounding (cancellation in a full gradient near 0) does not make a scale a mix.
        if one_share or (cosine > 1 - SAME_DIRECTION and math.isclose(norm, 1 / size, rel_tol=SHARE_TOLERANCE)):
            if any(entry.get("compensated") is not False for entry in entries):
                return None  # the loss × W (or a scale unknown): no evidence of a missing factor
            return "GATHERED_LOSS_WITHOUT_WORLD_SIZE", _scale_detail(first, size), _scale_fix(first, size)
        if all(math.isclose(share, 1, rel_tol=SHARE_TOLERANCE) for share in shares):
            return None  # the other ranks' losses send these rows nothing: nothing was dropped
        return "GATHERED_TERMS_MISSING", _missing_detail(first, size, norm, cosine), None
    return None


def _groups(records: list[dict[str, Any]]) -> list[list[dict]]:
    """The same cat on every rank (by step, backward, slice shape and order), one entry per rank, slice order."""
    groups: dict[tuple, dict[int, dict]] = {}
    for record in records:
        for entry in record.get("gathered_slices", []):
            key = (entry["step"], entry["backward"], tuple(entry["shape"]), entry["ordinal"])
            groups.setdefault(key, {})[entry["kept"]] = entry
    complete = []
    for key in sorted(groups):
        by_kept = groups[key]
        size = next(iter(by_kept.values()))["size"]
        # Every rank of one group, and no other ranks: two groups' cats under a mesh are not told apart.
        if size == len(records) and sorted(by_kept) == list(range(size)) and \
                all(entry["size"] == size and len(entry["samples"]) == size for entry in by_kept.values()):
            complete.append([by_kept[rank] for rank in range(size)])
    return complete


def _kept_and_full(entries: list[dict]) -> list[tuple[list[float], list[float]]]:
    """Per slice, its sampled elements as its own rank kept them and as the W ranks' losses sent them in all."""
    return [(owner["samples"][slice_index],
             [sum(values) for values in zip(*(entry["samples"][slice_index] for entry in entries))])
            for slice_index, owner in enumerate(entries)]


def _shares(entries: list[dict]) -> list[float]:
    """kept / full at every sampled element of every slice whose full gradient is not negligible."""
    shares = []
    for kept, full in _kept_and_full(entries):
        largest = max((abs(value) for value in full), default=0.0)
        if not largest:
            continue
        shares += [part / whole for part, whole in zip(kept, full) if abs(whole) > NEGLIGIBLE * largest]
    return shares


def _kept_against_full(entries: list[dict]) -> tuple[float, float]:
    """Over the sampled elements of every slice: the kept part's norm over the full gradient's, and their cosine."""
    pairs = _kept_and_full(entries)
    kept = [value for part, _ in pairs for value in part]
    full = [value for _, whole in pairs for value in whole]
    kept_norm, full_norm = math.sqrt(sum(v * v for v in kept)), math.sqrt(sum(v * v for v in full))
    dot = sum(a * b for a, b in zip(kept, full))
    if not (kept_norm and full_norm):
        return 0.0, 0.0
    return kept_norm / full_norm, dot / (kept_norm * full_norm)


def _named(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return f"{len(names)} parameter tensor{'s' if len(names) != 1 else ''} ({shown}{', …' if len(names) > 3 else ''})"


def _where(entry: dict) -> str:
    return f"the loss at {entry['site']}" if entry.get("site") else "the loss"


def _scale_detail(entry: dict, size: int) -> str:
    through, outside = entry.get("through") or [], entry.get("outside") or []
    named = f"; behind the slices, at 1/{size}: {_named(through)}" if through else ""
    if outside:
        named += f"; reached outside the gather, whole: {_named(outside)}"
    return (f"{_where(entry)} was computed over features gathered from the {size} ranks without autograd, each "
            f"rank's own slice put back with its graph; at step {entry['step']} every rank's slice kept exactly "
            f"1/{size} of what the {size} ranks' losses sent it (the same loss on every rank), and the loss is not "
            f"multiplied by {size}{named}")


def _scale_fix(entry: dict, size: int) -> str | None:
    """Multiplying by W is no fix where parameters outside the gather already get all of their gradient."""
    if not entry.get("outside"):
        return None
    return ("gather with torch.distributed.nn.functional.all_gather (open_clip: --gather-with-grad), whose backward "
            f"sums every rank's share back into each slice; multiplying the loss by {size} would mend the parameters "
            f"behind the slices but make those outside the gather ({', '.join(entry['outside'][:3])}) get {size} "
            "times their gradient")


def _missing_detail(entry: dict, size: int, norm: float, cosine: float) -> str:
    return (f"{_where(entry)} was computed over features gathered from the {size} ranks without autograd, each "
            f"rank's own slice put back with its graph; at step {entry['step']}, on a few elements of each slice, what "
            f"its rank kept had {norm:.3g} of the norm of what the {size} ranks' losses sent it, at cosine "
            f"{cosine:.3f} (a scale would be 1/{size} at cosine 1): the ranks' losses differ, and the gradient lacks "
            "the terms the other ranks' losses owe each rank's rows")
