"""`python -m fmha_rt check`: every code object of the manifest against its file, hash and layout."""
from __future__ import annotations

from collections import Counter

from ..errors import FmhaError
from .registry import Registry


def check_all(reg: Registry) -> tuple[Counter, list[str]]:
    """Load and verify every kernel of every arch; returns (kernels per arch, problems)."""
    per_arch, problems = Counter(), []
    for entry in reg.entries.values():
        per_arch[entry.arch] += 1
        try:
            reg.image(entry)
        except FmhaError as exc:
            problems.append(f"{entry.arch}/{entry.key}: {exc}")
    return per_arch, problems
