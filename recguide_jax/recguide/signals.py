"""Verifier-history signals of RecGuide's adaptive drafting (docs/spec/recguide.md §5.1), computed online after
every verification of a request from completed causal-verify information only:
- e_t = `round_entropy(...)`: mean verifier entropy over the round's causally valid verify positions;
- s_t = `signal_s(history)`: minus the mean of the last <= 2 round entropies (None before the first round);
- z_t = `stratum(history)`: (previous B, previous block fully accepted) as "b8_partial" .. "b32_full".
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import numpy as np

from recguide_jax.model.config import BLOCK_SIZES

STRATA = tuple(f"b{b}_{'full' if full else 'partial'}" for b in BLOCK_SIZES for full in (False, True))


def valid_positions(accepted, block_size, eos, head_cap: int | None = None) -> np.ndarray:
  """How many verify positions of a round are causally valid (`round_entropy`), for one round or an array of them:
  accepted - 1 with an EOS among the emitted tokens, B - 1 for a full block, else accepted; at most `head_cap`."""
  accepted, block_size = np.asarray(accepted, np.int64), np.asarray(block_size, np.int64)
  if np.any(block_size < 1) or np.any(accepted < 1) or np.any(accepted > block_size):
    raise ValueError(f"a round needs 1 <= accepted <= block_size, got accepted={accepted.tolist()}, "
                     f"block_size={block_size.tolist()}")
  if head_cap is not None and head_cap < 1:
    raise ValueError(f"head_cap must be >= 1 or None, got {head_cap}")
  n = np.where(np.asarray(eos, bool), accepted - 1, np.where(accepted >= block_size, block_size - 1, accepted))
  return n if head_cap is None else np.minimum(n, head_cap)


def round_entropy(entropies_row: Sequence[float], accepted: int, block_size: int, eos: bool = False,
                  head_cap: int | None = None) -> float | None:
  """e_t: mean verifier entropy over the causally valid verify positions of one round (None when there are none).

  entropies_row[i] is the entropy at verify position i (which predicts draft token i+1). Valid positions:
  - partial block (accepted < B): the m = accepted-1 accepted decisions plus the first rejected one, m+1 positions;
  - full block (accepted = B): the B-1 decisions that were all accepted (the bonus position is excluded);
  - EOS in the emitted tokens: accepted-1 positions, with `accepted` counted through the first EOS.
  `head_cap` keeps only the first min(head_cap, #valid) positions (the author's code uses 7, the paper none).
  """
  n = int(valid_positions(accepted, block_size, eos, head_cap))
  row = entropies_row if isinstance(entropies_row, np.ndarray) else np.asarray(entropies_row, np.float64)
  if row.ndim != 1 or row.shape[0] < n:
    raise ValueError(f"entropies_row must be 1-D with >= {n} positions, got shape {row.shape}")
  e = float(round_entropies(row[None, :], [accepted], [block_size], [eos], head_cap)[0])
  return None if e != e else e  # (e != e: NaN, no valid position)


def round_entropies(entropies: np.ndarray, accepted: Sequence[int], block_size: Sequence[int],
                    eos: Sequence[bool], head_cap: int | None = None) -> np.ndarray:
  """`round_entropy` of each row of `entropies` [rows, width] at once, float64 (NaN where `round_entropy` is
  None)."""
  n = valid_positions(accepted, block_size, eos, head_cap)
  if entropies.ndim != 2 or len(n) != entropies.shape[0] or (len(n) and n.max() > entropies.shape[1]):
    raise ValueError(f"entropies must be [rows, >= {int(n.max(initial=0))}] with one row per round, got shape "
                     f"{entropies.shape}")
  if not len(n):
    return np.zeros((0,), np.float64)
  # each row's positions summed in order, in float64 whatever the dtype: the same floats at any row width
  width = max(int(n.max()), 1)
  sums = np.cumsum(entropies[:, :width], axis=1, dtype=np.float64)[np.arange(len(n)), np.maximum(n - 1, 0)]
  return np.where(n > 0, sums / np.maximum(n, 1), np.nan)


class RoundRecord(NamedTuple):
  """One verification round of a request, as the adaptive policy remembers it (a named tuple: one is made per
  request and round, so it is cheap to build)."""
  block_size: int
  accepted: int
  entropy: float | None  # e_t from round_entropy (None when no position was valid)

  @property
  def full(self) -> bool:
    return self.accepted >= self.block_size


def make_record(entropies_row: Sequence[float], accepted: int, block_size: int, eos: bool = False,
                head_cap: int | None = None) -> RoundRecord:
  return RoundRecord(block_size, accepted, round_entropy(entropies_row, accepted, block_size, eos, head_cap))


def as_record(entry: RoundRecord | Mapping) -> RoundRecord:
  """A history entry as a RoundRecord; mappings use the keys of docs/spec/recguide.md §5.5: {B, accept_len (or
  accepted), e}."""
  if isinstance(entry, RoundRecord):
    return entry
  try:
    b = entry["B"] if "B" in entry else entry["block_size"]
    accepted = entry["accept_len"] if "accept_len" in entry else entry["accepted"]
  except (KeyError, TypeError):
    raise ValueError(f"a history entry needs B (or block_size) and accept_len (or accepted), got {entry!r}") from None
  return RoundRecord(int(b), int(accepted), entry.get("e", entry.get("entropy")))


def signal_s(history: Sequence[RoundRecord | Mapping], window: int = 2) -> float | None:
  """s_t = -mean(e over the last <= `window` rounds); rounds without an entropy are skipped; None if none is left."""
  es = [e for e in (as_record(r).entropy for r in history[-window:]) if e is not None]
  if not es:
    return None
  return -float(sum(es) / len(es))


def stratum_name(block_size: int, full: bool) -> str | None:
  """"b{B}_full" / "b{B}_partial" for B in 8/16/32, else None (the model's "all" table is used)."""
  if block_size not in BLOCK_SIZES:
    return None
  return f"b{block_size}_{'full' if full else 'partial'}"


def stratum(history: Sequence[RoundRecord | Mapping]) -> str | None:
  """z_t = (B_{t-1}, F_{t-1}) as a stratum name; None without history."""
  if not history:
    return None
  last = as_record(history[-1])
  return stratum_name(last.block_size, last.full)
