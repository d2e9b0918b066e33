"""Verifier-history signals and the value model V_B(s, z) of RecGuide's adaptive drafting (recguide.md 5.1-5.2).

Signals, computed after every verification of a request from completed causal-verify information only:
- e_t = `round_entropy(...)`: mean verifier entropy over the round's causally valid verify positions;
- s_t = `signal_s(history)`: minus the mean of the last <= 2 round entropies (None before the first round);
- z_t = `stratum(history)`: (previous B, previous block fully accepted) as "b8_partial" .. "b32_full".

V_B(s, z) is the expected accepted length of a block of B: the sum over k of survival tables S_B[bin(s)][k] =
P(A_B >= k | s in bin), fitted per stratum z from shadow traces with counterfactual accepted lengths.

Shadow-trace JSONL, one object per line = one round of one request (written by the engine's shadow collector):

  {
    "dataset": "gsm8k",          # str, required: macro-averaging group
    "request_id": "gsm8k-17",    # str (ints are accepted and turned into strings), unique within the dataset
    "round": 3,                  # int >= 0: round index t within the request (0 = no history yet)
    "s": -0.41,                  # float or null: signal_s(history before this round); null when undefined
    "z": "b16_full",             # str or null: stratum(history before this round); one of STRATA
    "A": {"8": 8, "16": 13, "32": 13},  # counterfactual accepted lengths from the same state, 1 <= A_B <= B
    "B": 16,                     # optional: block size the collector committed
    "C": 8,                      # optional: concurrency the trace was collected at
    "head_cap": null             # optional: the e_t head cap used for s (null = all valid positions)
  }

Only rounds with t >= 1 (history present) fit the model; every round is replayed when solving rho. Unknown extra
fields are kept and ignored.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import pathlib
import types
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

SCHEMA = "recguide-value-model/1"
BLOCK_SIZES = (8, 16, 32)
STRATA = tuple(f"b{b}_{'full' if full else 'partial'}" for b in BLOCK_SIZES for full in (False, True))
SIGNAL = "verify_entropy_ma2"


class TraceError(ValueError):
  """A shadow-trace row or a value-model file is malformed; the message names the field (and file:line)."""


# ---- signals -------------------------------------------------------------------------------------------------------
def round_entropy(entropies_row: Sequence[float], accepted: int, block_size: int, eos: bool = False,
                  head_cap: int | None = None) -> float | None:
  """e_t: mean verifier entropy over the causally valid verify positions of one round (None when there are none).

  entropies_row[i] is the entropy at verify position i (which predicts draft token i+1). Valid positions:
  - partial block (accepted < B): the m = accepted-1 accepted decisions plus the first rejected one, m+1 positions;
  - full block (accepted = B): the B-1 decisions that were all accepted (the bonus position is excluded);
  - EOS in the emitted tokens: accepted-1 positions, with `accepted` counted through the first EOS.
  `head_cap` keeps only the first min(head_cap, #valid) positions (the author's code uses 7, the paper none).
  """
  if block_size < 1 or accepted < 1 or accepted > block_size:
    raise ValueError(f"round_entropy needs 1 <= accepted <= block_size, got accepted={accepted}, "
                     f"block_size={block_size}")
  if head_cap is not None and head_cap < 1:
    raise ValueError(f"head_cap must be >= 1 or None, got {head_cap}")
  if eos:
    n = accepted - 1
  elif accepted >= block_size:
    n = block_size - 1
  else:
    n = accepted
  if head_cap is not None:
    n = min(n, head_cap)
  row = entropies_row if isinstance(entropies_row, np.ndarray) else np.asarray(entropies_row, np.float64)
  if row.ndim != 1 or row.shape[0] < n:
    raise ValueError(f"entropies_row must be 1-D with >= {n} positions, got shape {row.shape}")
  if n <= 0:
    return None
  return float(row[:n].mean(dtype=np.float64))  # accumulated in float64 whatever the row's dtype


@dataclasses.dataclass(frozen=True)
class RoundRecord:
  """One verification round of a request, as the adaptive policy remembers it."""
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
  """A history entry as a RoundRecord; mappings use recguide.md 5.5's keys {B, accept_len (or accepted), e}."""
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


# ---- trace rows ------------------------------------------------------------------------------------------------------
def validate_row(row: Any, where: str = "trace row") -> dict:
  """Checks one shadow-trace row and returns a normalised copy (A keyed by int, request_id a str)."""
  if not isinstance(row, Mapping):
    raise TraceError(f"{where}: a row must be a JSON object")
  for key in ("dataset", "request_id", "round", "A"):
    if key not in row:
      raise TraceError(f"{where}: missing field {key!r}")
  out = dict(row)
  if not isinstance(row["dataset"], str) or not row["dataset"]:
    raise TraceError(f"{where}: field 'dataset' must be a non-empty string, got {row['dataset']!r}")
  rid = row["request_id"]
  if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
    raise TraceError(f"{where}: field 'request_id' must be a non-empty string, got {rid!r}")
  out["request_id"] = str(rid)
  t = row["round"]
  if isinstance(t, bool) or not isinstance(t, int) or t < 0:
    raise TraceError(f"{where}: field 'round' must be an integer >= 0, got {t!r}")
  s = row.get("s")
  if s is not None:
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
      raise TraceError(f"{where}: field 's' must be a finite number or null, got {s!r}")
    out["s"] = float(s)
  else:
    out["s"] = None
  z = row.get("z")
  if z is not None and z not in STRATA:
    raise TraceError(f"{where}: field 'z' must be null or one of {list(STRATA)}, got {z!r}")
  out["z"] = z
  a = row["A"]
  if not isinstance(a, Mapping) or not a:
    raise TraceError(f"{where}: field 'A' must be an object {{B: accepted length}}")
  parsed = {}
  for key, value in a.items():
    try:
      b = int(key)
    except (TypeError, ValueError):
      raise TraceError(f"{where}: field 'A' has a non-integer block size {key!r}") from None
    if b < 1:
      raise TraceError(f"{where}: field 'A' has block size {b} < 1")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= b:
      raise TraceError(f"{where}: field 'A[{b}]' must be an integer in [1, {b}], got {value!r}")
    parsed[b] = value
  out["A"] = dict(sorted(parsed.items()))
  cap = row.get("head_cap")
  if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
    raise TraceError(f"{where}: field 'head_cap' must be a positive integer or null, got {cap!r}")
  return out


def validate_rows(rows: Iterable[Any]) -> list[dict]:
  """Validates rows and checks they agree on the A block sizes and hold no duplicate (dataset, request, round)."""
  out, seen, blocks = [], set(), None
  for i, row in enumerate(rows):
    where = row.pop("_where", f"row {i}") if isinstance(row, dict) and "_where" in row else f"row {i}"
    r = validate_row(row, where)
    key = (r["dataset"], r["request_id"], r["round"])
    if key in seen:
      raise TraceError(f"{where}: duplicate round {r['round']} of request {r['request_id']!r} in {r['dataset']!r}")
    seen.add(key)
    if blocks is None:
      blocks = tuple(r["A"])
    elif tuple(r["A"]) != blocks:
      raise TraceError(f"{where}: field 'A' has block sizes {list(r['A'])}, earlier rows have {list(blocks)}")
    out.append(r)
  return out


def load_trace_rows(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[dict]:
  """Reads and validates shadow-trace JSONL files (blank lines skipped); errors name file:line."""
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  raw = []
  for path in paths:
    path = pathlib.Path(path)
    if not path.is_file():
      raise TraceError(f"trace file {path} does not exist")
    with path.open() as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError as e:
          raise TraceError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(row, dict):
          row["_where"] = f"{path}:{n}"
        raw.append(row)
  return validate_rows(raw)


def nested_weights(rows: Sequence[Mapping]) -> np.ndarray:
  """w = 1/#datasets * 1/#requests in the dataset * 1/#rounds of the request (sums to 1 over the rows)."""
  per_request: dict[tuple[str, str], int] = {}
  per_dataset: dict[str, set] = {}
  for r in rows:
    per_request[(r["dataset"], r["request_id"])] = per_request.get((r["dataset"], r["request_id"]), 0) + 1
    per_dataset.setdefault(r["dataset"], set()).add(r["request_id"])
  nd = len(per_dataset)
  return np.array([1.0 / nd / len(per_dataset[r["dataset"]]) / per_request[(r["dataset"], r["request_id"])]
                   for r in rows], np.float64)


# ---- fitting -------------------------------------------------------------------------------------------------------
def weighted_quantile_edges(s: np.ndarray, w: np.ndarray, bins: int) -> np.ndarray:
  """bins-1 cut points at the weighted quantiles i/bins of s, deduplicated. A cut is the first sorted value whose
  cumulative weight exceeds the quantile, and values equal to a cut go to the upper bin, so each bin holds its
  1/bins share of the weight (up to ties); a cut at the minimum (an always-empty lowest bin) is dropped."""
  order = np.argsort(s, kind="stable")
  ss, cw = s[order], np.cumsum(w[order])
  # the tolerance keeps float round-off in the cumulative sum from moving a cut by one value
  qs = np.arange(1, bins) / bins * cw[-1] + 1e-9 * cw[-1]
  idx = np.clip(np.searchsorted(cw, qs, side="right"), 0, len(ss) - 1)
  edges = np.unique(ss[idx])
  return edges[edges > ss[0]]


def weighted_pava(y: np.ndarray, w: np.ndarray) -> np.ndarray:
  """Weighted isotonic (non-decreasing) least-squares fit by pool-adjacent-violators. Zero-weight points take the
  value of the block they fall in."""
  blocks: list[list[float]] = []  # [mean, weight, count]
  for yi, wi in zip(np.asarray(y, float), np.asarray(w, float)):
    blocks.append([yi, wi, 1])
    while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
      m2, w2, c2 = blocks.pop()
      m1, w1, c1 = blocks.pop()
      wt = w1 + w2
      mean = (m1 * w1 + m2 * w2) / wt if wt > 0 else (m1 * c1 + m2 * c2) / (c1 + c2)
      blocks.append([mean, wt, c1 + c2])
  return np.concatenate([np.full(c, m) for m, _, c in blocks]) if blocks else np.zeros(0)


def _survival(a: np.ndarray, w: np.ndarray, b: int) -> np.ndarray:
  """Weighted P(A >= k) for k = 1..b over the given rows."""
  ge = a[:, None] >= np.arange(1, b + 1)[None, :]
  return np.clip((w[:, None] * ge).sum(0) / w.sum(), 0.0, 1.0)  # clip: weighted sums round past 1


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
    # the same numbers as Python floats for the per-request runtime lookup (a bisect over a tuple is several times
    # cheaper than a numpy call on a few floats, and the lookup runs for every request and round)
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

  def values(self, s: float | None) -> dict[int, float]:
    """V_B(s) for every B, with one bin lookup."""
    i = self.bin_index(s)
    if i is None:
      return dict(self._uncond_values)
    return {b: v[i] for b, v in self._bin_value_floats.items()}


def _fit_table(s: np.ndarray, w: np.ndarray, a: Mapping[int, np.ndarray], bins: int) -> SurvivalTable:
  has_s = np.isfinite(s)
  edges = np.zeros(0)
  if has_s.sum() >= max(24, 2 * bins):
    edges = weighted_quantile_edges(s[has_s], w[has_s], bins)
  nb = len(edges) + 1
  idx = np.searchsorted(edges, s[has_s], side="right")
  ws = w[has_s]
  bin_w = np.bincount(idx, weights=ws, minlength=nb)
  survival, unconditional = {}, {}
  for b, ab in a.items():
    uncond = np.minimum.accumulate(_survival(ab, w, b))
    if not has_s.any():
      table = uncond[None, :].copy()
    else:
      ge = (ab[has_s][:, None] >= np.arange(1, b + 1)[None, :]) * ws[:, None]
      sums = np.zeros((nb, b))
      np.add.at(sums, idx, ge)
      with np.errstate(invalid="ignore", divide="ignore"):
        table = np.where(bin_w[:, None] > 0, sums / bin_w[:, None], uncond[None, :])
      # higher s (lower entropy) must never predict a shorter acceptance: isotonic across bins per k
      for k in range(b):
        table[:, k] = weighted_pava(table[:, k], bin_w)
      # a survival function is non-increasing in k (and a probability despite float round-off)
      table = np.minimum.accumulate(np.clip(table, 0.0, 1.0), axis=1)
    survival[b] = table
    unconditional[b] = uncond
  return SurvivalTable(edges, survival, unconditional, rows=int(len(s)), weight=float(w.sum()))


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

  def table(self, z: str | None) -> SurvivalTable:
    return self.tables.get(z, self.tables["all"]) if z is not None else self.tables["all"]

  def value(self, b: int, s: float | None, z: str | None = None) -> float:
    if b not in self.block_sizes:
      raise KeyError(f"the value model has no block size {b} (has {list(self.block_sizes)})")
    return self.table(z).value(b, s)

  def values(self, s: float | None, z: str | None = None) -> dict[int, float]:
    return self.table(z).values(s)  # every table covers exactly block_sizes (checked at construction)

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


def fit_value_model(rows: Sequence[Mapping], bins: int = 24, strata: bool = True) -> ValueModel:
  """Fits V_B(s, z) (recguide.md 5.2) from shadow-trace rows (see the module docstring).

  Only rounds with history (round >= 1) train. Rows carry nested equal weights. The "all" table is always fitted;
  a z-stratum gets its own table when it has at least max(48, 3*bins) rows. Within a table, s is cut at weighted
  quantiles (when there are at least max(24, 2*bins) rows with s), survival is isotonic non-decreasing in s per k
  and non-increasing in k, and rows without s only shape the unconditional row used when s is undefined."""
  if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
    raise ValueError(f"bins must be a positive integer, got {bins!r}")
  rows = validate_rows(rows)
  train = [r for r in rows if r["round"] >= 1]
  if not train:
    raise TraceError("no trace rows with history (round >= 1) to fit the value model on")
  caps = {r.get("head_cap") for r in train}
  if len(caps) > 1:
    raise TraceError(f"trace rows mix signal head caps {sorted(caps, key=str)}; fit one signal definition at a time")
  blocks = tuple(train[0]["A"])
  w = nested_weights(train)
  s = np.array([np.nan if r["s"] is None else r["s"] for r in train], np.float64)
  a = {b: np.array([r["A"][b] for r in train], np.int64) for b in blocks}
  z = np.array([r["z"] or "" for r in train])
  tables = {"all": _fit_table(s, w, a, bins)}
  if strata:
    need = max(48, 3 * bins)
    for name in STRATA:
      sel = z == name
      if sel.sum() >= need:
        tables[name] = _fit_table(s[sel], w[sel], {b: v[sel] for b, v in a.items()}, bins)
  return ValueModel(tables, blocks, bins, head_cap=caps.pop())
