"""The labels of RecGuide's own rounds (what their wall time is recorded under and its cost model prices), beside
the generic rounds' `decoding.strategy.RoundKind`."""

from __future__ import annotations

import enum


class OverlapKind(enum.StrEnum):
  OVERLAP = "overlap"  # the fused forward: verifications + branches, and the drafts of requests that hold none
  OVERLAP_DRAFT = "overlap_draft"  # a step where no request holds a draft: a draft forward alone
