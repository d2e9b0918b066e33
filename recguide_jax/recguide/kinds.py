"""The labels of RecGuide's own rounds (what their wall time is recorded under and its cost model prices), beside
the generic rounds' `decoding.strategy.RoundKind`."""

from __future__ import annotations

import enum


class OverlapKind(enum.StrEnum):
  OVERLAP = "overlap"  # the fused verify + branches, every draft prefetched
  OVERLAP_DRAFT = "overlap_draft"  # the same round when it also ran a draft forward
