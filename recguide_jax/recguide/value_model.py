"""RecGuide's value model V_B(s, z) (docs/spec/recguide.md §5.1-5.2): the expected accepted length of a block of
B, the sum over k of survival tables S_B[bin(s)][k] = P(A_B >= k | s in bin) of the stratum z, looked up online for
every request and round; its versioned JSON ("recguide-value-model/1"). Fitted offline by `value_fit.py` from the
shadow traces of `traces.py`; the signals s and z are `signals.py`'s."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import math
import os
import pathlib
import types
from typing import Any, Mapping

import numpy as np

from recguide_jax.model.config import BLOCK_SIZES
from recguide_jax.recguide.signals import STRATA

SCHEMA = "recguide-value-model/1"
SIGNAL = "verify_entropy_ma2"


class TraceError(ValueError):
  """A shadow-trace row or a value-model file is malformed; the message names the field (and file:line)."""


def _frozen(a: np.ndarray) -> np.ndarray:
  a = np.array(a, np.float64)
  a.flags.writeable = False
  return a


@dataclasses.dataclass(frozen=True, eq=False)
class SurvivalTable:
  """Monotone binned survival of one stratum: survival[B][bin][k-1] = P(A_B >= k | s in bin)."""
  edges: np.ndarray  # [nbins - 1] increasing cut points of s
  survival: Mapping[int, np.ndarray]  # B -> [nbins, B]
  unconditional: Mapping[int, np.ndarray]  # B -> [B]: used when s is undefined
  rows: int = 0
  weight: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, "edges", _frozen(self.edges))
    object.__setattr__(self, "survival", types.MappingProxyType({int(b): _frozen(v)
                                                                  for b, v in self.survival.items()}))
    object.__setattr__(self, "unconditional", types.MappingProxyType({int(b): _frozen(v)
                                                                       for b, v in self.unconditional.items()}))
    # V per bin, precomputed once so the runtime lookup and the rho search use the very same floats
    object.__setattr__(self, "_bin_values", {b: _frozen(v.sum(1)) for b, v in self.survival.items()})
    object.__setattr__(self, "_uncond_values", {b: float(v.sum()) for b, v in self.unconditional.items()})
    # the same numbers as Python floats: the lookup runs per request and round, where a bisect over a tuple beats
    # a numpy call on a few floats
    object.__setattr__(self, "_edge_floats", tuple(float(e) for e in self.edges))
    object.__setattr__(self, "_bin_value_floats", {b: tuple(float(x) for x in v) for b, v in self._bin_values.items()})

  @property
  def num_bins(self) -> int:
    return len(self.edges) + 1

  def bin_index(self, s: float | None) -> int | None:
    if s is None or not math.isfinite(s):
      return None
    return bisect.bisect_right(self._edge_floats, s)  # == np.searchsorted(edges, s, side="right")

  def value(self, b: int, s: float | None) -> float:
    i = self.bin_index(s)
    return self._uncond_values[b] if i is None else self._bin_value_floats[b][i]

  def values_capped(self, s: float | None, cap: int) -> dict[int, float]:
    """E[min(A_B, cap) | s] = sum_{k <= cap} P(A_B >= k | s) for every B: the expected tokens of a round that may
    emit at most `cap` (a request near its max_tokens)."""
    i = self.bin_index(s)
    rows = self.unconditional if i is None else {b: v[i] for b, v in self.survival.items()}
    return {b: float(v[:max(cap, 0)].sum()) for b, v in rows.items()}

  def values(self, s: float | None) -> dict[int, float]:
    """V_B(s) for every B, with one bin lookup."""
    i = self.bin_index(s)
    if i is None:
      return dict(self._uncond_values)
    return {b: v[i] for b, v in self._bin_value_floats.items()}


@dataclasses.dataclass(frozen=True, eq=False)
class ValueGrid:
  """Every value of a value model as one array, so a step's requests are looked up together: `values[row, j, k]` is
  E[min(A_B, k)] for B = `block_sizes[j]` and k < `uncapped`, and V_B itself at k = `uncapped`; `height` rows per
  table, its first for s undefined, then one per bin of s (`ValueModel.grid_row`). The floats are those
  `SurvivalTable.values` and `values_capped` return."""
  values: np.ndarray  # [tables * height, len(block_sizes), uncapped + 1]
  height: int  # rows per table: 1 + its most bins
  tables: Mapping[str, int]  # table name -> its index (its rows start at index * height)
  edges: np.ndarray  # [tables, height - 2]: each table's bin edges, padded with +inf
  stratum_tables: np.ndarray  # [len(STRATA) + 1]: the table each stratum reads ("all" where unfitted, and last)
  uncapped: int  # the cap index that reads V_B uncapped: max(block_sizes)


def _grid(tables: Mapping[str, SurvivalTable], block_sizes: tuple[int, ...]) -> ValueGrid:
  uncapped = max(block_sizes)
  height = 1 + max(t.num_bins for t in tables.values())
  values = np.zeros((len(tables) * height, len(block_sizes), uncapped + 1), np.float64)
  edges = np.full((len(tables), height - 2), np.inf)
  for n, t in enumerate(tables.values()):
    first = n * height
    edges[n, :len(t.edges)] = t.edges
    for j, b in enumerate(block_sizes):
      survival = np.concatenate([t.unconditional[b][None, :], t.survival[b]])  # row 0: s undefined
      for k in range(uncapped):  # a row's prefix sum as `values_capped` takes it, not a running cumsum
        values[first:first + len(survival), j, k] = survival[:, :k].sum(axis=1)
      values[first:first + len(survival), j, uncapped] = [t._uncond_values[b], *t._bin_value_floats[b]]
  index = {name: n for n, name in enumerate(tables)}
  stratum_tables = np.array([index.get(z, index["all"]) for z in STRATA] + [index["all"]], np.int64)
  for a in (values, edges, stratum_tables):
    a.flags.writeable = False
  return ValueGrid(values, height, types.MappingProxyType(index), edges, stratum_tables, uncapped)


@dataclasses.dataclass(frozen=True, eq=False)
class ValueModel:
  """V_B(s, z) = sum_k S_B[bin(s)][k] from the table of stratum z, or of "all" when z was not fitted."""
  tables: Mapping[str, SurvivalTable]
  block_sizes: tuple[int, ...] = BLOCK_SIZES
  bins: int = 24
  head_cap: int | None = None  # the e_t head cap the signal s was computed with (the runtime must match it)
  window: int = 2  # rounds averaged by signal_s
  signal: str = SIGNAL

  def __post_init__(self):
    if "all" not in self.tables:
      raise TraceError("a value model needs an 'all' table")
    object.__setattr__(self, "tables", types.MappingProxyType(dict(self.tables)))
    object.__setattr__(self, "block_sizes", tuple(int(b) for b in self.block_sizes))
    for name, table in self.tables.items():
      if sorted(table.survival) != sorted(self.block_sizes):
        raise TraceError(f"value model table {name!r} covers blocks {sorted(table.survival)}, "
                         f"expected {list(self.block_sizes)}")

  @functools.cached_property
  def grid(self) -> ValueGrid:
    """This model's values as one array (`ValueGrid`), built on first use."""
    return _grid(self.tables, self.block_sizes)

  def grid_row(self, s: float | None, z: str | None) -> int:
    """The `grid` row of V_B(s, z)."""
    name = z if z is not None and z in self.tables else "all"
    i = self.tables[name].bin_index(s)
    return self.grid.tables[name] * self.grid.height + (0 if i is None else i + 1)

  def grid_rows(self, s: np.ndarray, strata: np.ndarray) -> np.ndarray:
    """`grid_row` of many (s, z) at once: `s` with NaN where undefined, `strata` each z's index in `STRATA` (-1:
    none)."""
    grid = self.grid
    tables = grid.stratum_tables[strata]
    bins = 1 + (s[:, None] >= grid.edges[tables]).sum(axis=1)  # edges at or below s: `bin_index`'s bisect_right
    return tables * grid.height + np.where(np.isfinite(s), bins, 0)

  def table(self, z: str | None) -> SurvivalTable:
    return self.tables.get(z, self.tables["all"]) if z is not None else self.tables["all"]

  def value(self, b: int, s: float | None, z: str | None = None) -> float:
    if b not in self.block_sizes:
      raise KeyError(f"the value model has no block size {b} (has {list(self.block_sizes)})")
    return self.table(z).value(b, s)

  def values(self, s: float | None, z: str | None = None) -> dict[int, float]:
    return self.table(z).values(s)  # every table covers exactly block_sizes (checked at construction)

  def values_capped(self, s: float | None, z: str | None, cap: int) -> dict[int, float]:
    """V_B(s, z) of a round that may emit at most `cap` tokens (`SurvivalTable.values_capped`)."""
    return self.table(z).values_capped(s, cap)

  # ---- JSON --------------------------------------------------------------------------------------------------------
  def to_json(self) -> dict:
    return {
        "schema": SCHEMA, "signal": self.signal, "window": self.window, "head_cap": self.head_cap,
        "bins": self.bins, "block_sizes": list(self.block_sizes),
        "tables": {name: {"rows": t.rows, "weight": t.weight, "edges": t.edges.tolist(),
                          "survival": {str(b): v.tolist() for b, v in t.survival.items()},
                          "unconditional": {str(b): v.tolist() for b, v in t.unconditional.items()}}
                   for name, t in self.tables.items()},
    }

  @classmethod
  def from_json(cls, raw: Any, where: str = "value model") -> "ValueModel":
    if not isinstance(raw, Mapping):
      raise TraceError(f"{where}: must be a JSON object")
    if raw.get("schema") != SCHEMA:
      raise TraceError(f"{where}: field 'schema' must be {SCHEMA!r}, got {raw.get('schema')!r}")
    for key in ("block_sizes", "tables", "bins"):
      if key not in raw:
        raise TraceError(f"{where}: missing field {key!r}")
    blocks = raw["block_sizes"]
    if not isinstance(blocks, list) or not blocks or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                                          for b in blocks):
      raise TraceError(f"{where}: field 'block_sizes' must be a list of positive integers, got {blocks!r}")
    if not isinstance(raw["tables"], Mapping):
      raise TraceError(f"{where}: field 'tables' must be an object")
    tables = {}
    for name, t in raw["tables"].items():
      field = f"{where}: tables[{name!r}]"
      if name != "all" and name not in STRATA:
        raise TraceError(f"{field}: unknown stratum (expected 'all' or one of {list(STRATA)})")
      try:
        edges = np.asarray(t["edges"], np.float64).reshape(-1)
        if np.any(np.diff(edges) <= 0) or not np.all(np.isfinite(edges)):
          raise TraceError(f"{field}.edges must be finite and strictly increasing")
        survival, uncond = {}, {}
        for b in blocks:
          sv = np.asarray(t["survival"][str(b)], np.float64)
          un = np.asarray(t["unconditional"][str(b)], np.float64)
          if sv.shape != (len(edges) + 1, b) or un.shape != (b,):
            raise TraceError(f"{field}: survival[{b}] must be [{len(edges) + 1}, {b}] and unconditional[{b}] "
                             f"[{b}], got {list(sv.shape)} and {list(un.shape)}")
          if not (np.all((sv >= 0) & (sv <= 1)) and np.all((un >= 0) & (un <= 1))):
            raise TraceError(f"{field}: survival probabilities for B={b} must lie in [0, 1]")
          survival[b], uncond[b] = sv, un
        tables[name] = SurvivalTable(edges, survival, uncond, rows=int(t.get("rows", 0)),
                                     weight=float(t.get("weight", 0.0)))
      except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, TraceError):
          raise
        raise TraceError(f"{field}: malformed ({type(e).__name__}: {e})") from None
    head_cap = raw.get("head_cap")
    if head_cap is not None and (isinstance(head_cap, bool) or not isinstance(head_cap, int) or head_cap < 1):
      raise TraceError(f"{where}: field 'head_cap' must be a positive integer or null, got {head_cap!r}")
    return cls(tables, tuple(blocks), int(raw["bins"]), head_cap, int(raw.get("window", 2)),
               str(raw.get("signal", SIGNAL)))

  def save(self, path: str | os.PathLike) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(self.to_json()) + "\n")

  @classmethod
  def load(cls, path: str | os.PathLike) -> "ValueModel":
    path = pathlib.Path(path)
    try:
      raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
      raise TraceError(f"{path}: not valid JSON ({e})") from None
    return cls.from_json(raw, str(path))
