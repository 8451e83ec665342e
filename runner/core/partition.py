"""Balanced partitions: any global size over any number of parts, sizes differing by at most one."""

from __future__ import annotations


def balanced_sizes(total: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous pieces of `total`; the first `total % parts` get one more."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def balanced_slice(total: int, parts: int, index: int) -> slice:
    """The slice of piece `index` in the balanced partition of `total` into `parts`."""
    if not 0 <= index < parts:
        raise ValueError(f"index {index} outside 0..{parts - 1}")
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return slice(start, start + base + (1 if index < extra else 0))
