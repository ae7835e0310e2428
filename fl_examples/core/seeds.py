"""The seed tree the trainers share: :class:`privkit.seeds.SeedTree` (one implementation)."""

from privkit.seeds import STREAMS, SeedTree

__all__ = ["SeedTree", "STREAMS"]
