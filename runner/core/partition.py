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


class Partition:
    """A global extent split into balanced contiguous pieces, one per rank of a group."""

    def __init__(self, total: int, parts: int) -> None:
        self.total, self.parts = total, parts
        self.sizes = balanced_sizes(total, parts)
        self.offsets = [sum(self.sizes[:i]) for i in range(parts)]
        self._counts: dict[int, list[int]] = {}

    def counts(self, inner: int) -> list[int]:
        """Element counts of the pieces when each unit of the split dim holds `inner` elements
        (cached: layers ask for the same counts every step)."""
        cached = self._counts.get(inner)
        if cached is None:
            cached = self._counts[inner] = [size * inner for size in self.sizes]
        return cached

    def slice(self, index: int) -> slice:
        return slice(self.offsets[index], self.offsets[index] + self.sizes[index])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Partition) and (self.total, self.parts) == (other.total,
                                                                              other.parts)

    def __hash__(self) -> int:
        return hash((self.total, self.parts))

    def __repr__(self) -> str:
        return f"Partition({self.total} over {self.parts}: {self.sizes})"
