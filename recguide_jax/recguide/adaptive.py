"""RecGuide's adaptive block size (docs/spec/recguide.md §5.4-5.5): the rule B*_t = argmax_B V_B(s_t, z_t) -
rho_C * T_C(B) and the frozen per-load tables fitted for a checkpoint and shipped beside it (`RecGuideTables`;
rho_C is searched offline by `rho_search.py`).

Tables JSON `recguide_tables.json`, schema "recguide-tables/1" (written by launch/fit_tables.py, read by
`load_tables`):

  {
    "schema": "recguide-tables/1",
    "version": "3f2a9c1b7d4e",        # content hash unless a tag was given: identifies the frozen tables
    "profile": "b200_nld8b",          # the hardware profile the costs came from
    "notes": "...",
    "levels": [                       # one entry per fitted concurrency level C
      {"concurrency": 8, "rho": 0.21, "cold_start_block": 16,
       "costs_ms": {"8": 17.114, "16": 18.737, "32": 21.478},       # T_C(B) the price rho was solved against
       "objective": 0.29, "fixed_objectives": {"8": ..., "16": ..., "32": ...},   # tokens/ms/request (replay)
       "shares": {"8": 0.05, "16": 0.40, "32": 0.55}}                # macro share of rounds per chosen B
    ],
    "value_model": { ... "recguide-value-model/1" ... },
    "overlap_planner": "expected_hit", "overlap_delta": 0.5, "overlap_slots": 4,   # optional (launch/fit_delta.py)
    "overlap_prefix_exponent": 0.45, "overlap_hit_rate": 0.47
  }

At runtime a load C uses the nearest fitted level (in log2 C, ties to the smaller level) for rho, costs and the
cold-start block, so the decision always pairs a price with the costs it was solved against.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import types
from typing import Any, Mapping, Sequence

import numpy as np

from recguide_jax.recguide import signals as sig
from recguide_jax.recguide import value_model as vm
from recguide_jax.recguide.overlap import MAX_SLOTS, PLANNERS

SCHEMA = "recguide-tables/1"
TABLES_FILENAME = "recguide_tables.json"  # where a checkpoint directory ships its fitted tables
# NLD's official fixed recipe = the "Fixed Block" baseline, used for a request's first round (no history yet)
COLD_START = types.MappingProxyType({1: 32, 2: 32, 4: 32, 8: 16, 16: 16, 32: 16, 64: 8, 128: 8})
LINSPACE_POINTS = 33


class TablesError(ValueError):
  """A tables file is malformed or the tables were asked something they cannot answer; the message names the
  field."""


def nearest_level(c: float, levels: Sequence[int]) -> int:
  """The level closest to C in log2 (load scales multiplicatively); ties go to the smaller level."""
  if isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0:
    raise TablesError(f"concurrency C must be a positive number, got {c!r}")
  if not levels:
    raise TablesError("no concurrency levels to choose from")
  x = math.log2(c)
  return min(sorted(levels), key=lambda level: abs(math.log2(level) - x))


def cold_start_block(c: float, table: Mapping[int, int] = COLD_START) -> int:
  """First-round B by load: C <= 4 -> 32, 8..32 -> 16, >= 64 -> 8 (other C: the nearest listed level)."""
  return table[nearest_level(c, tuple(table))]


def decide(value_model: vm.ValueModel, rho: float, costs: Mapping[int, float], s: float | None,
           z: str | None) -> int:
  """argmax_B V_B(s, z) - rho * T(B) over the blocks in `costs`, scanned in increasing B with a strict ">" so an
  exact tie keeps the smaller block."""
  if not costs:
    raise TablesError("decide needs at least one block cost")
  if not math.isfinite(rho):
    raise TablesError(f"rho must be finite, got {rho!r}")
  best, best_u = None, -math.inf
  for b in sorted(costs):
    u = value_model.value(b, s, z) - rho * costs[b]
    if best is None or u > best_u:
      best, best_u = b, u
  return best


def decide_grid(value_model: vm.ValueModel, rho: float, costs: Mapping[int, float]) -> np.ndarray:
  """`decide` at every row of `value_model.grid` at once (the block per grid row): the same floats, and an exact tie
  keeps the smaller block (argmax takes the first of the increasing blocks)."""
  if not costs:
    raise TablesError("decide needs at least one block cost")
  grid, blocks = value_model.grid, sorted(costs)
  columns = [value_model.block_sizes.index(b) for b in blocks]
  utility = grid.values[:, columns, grid.uncapped] - rho * np.array([costs[b] for b in blocks], np.float64)
  return np.asarray(blocks, np.int64)[np.argmax(utility, axis=1)]


# ---- frozen tables ---------------------------------------------------------------------------------------------------
def _int_keyed(raw: Any, field: str, positive_values: bool = True) -> Mapping[int, float]:
  if not isinstance(raw, Mapping) or not raw:
    raise TablesError(f"{field} must be a non-empty object keyed by block size")
  out = {}
  for k, v in raw.items():
    try:
      b = int(k)
    except (TypeError, ValueError):
      raise TablesError(f"{field} has a non-integer key {k!r}") from None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (
        positive_values and v <= 0):
      raise TablesError(f"{field}[{b}] must be a finite{' positive' if positive_values else ''} number, got {v!r}")
    out[b] = float(v)
  return types.MappingProxyType(dict(sorted(out.items())))


@dataclasses.dataclass(frozen=True)
class LevelTable:
  """The adaptive rule at one load level C: its price rho, the costs it was solved against, the cold start."""
  concurrency: int
  rho: float
  costs_ms: Mapping[int, float]
  cold_start_block: int
  objective: float | None = None
  fixed_objectives: Mapping[int, float] | None = None
  shares: Mapping[int, float] | None = None

  def __post_init__(self):
    where = f"levels[C={self.concurrency}]"
    if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
      raise TablesError(f"level concurrency must be a positive integer, got {self.concurrency!r}")
    if isinstance(self.rho, bool) or not isinstance(self.rho, (int, float)) or not math.isfinite(self.rho) \
        or self.rho < 0:
      raise TablesError(f"{where}.rho must be a finite number >= 0, got {self.rho!r}")
    object.__setattr__(self, "rho", float(self.rho))
    object.__setattr__(self, "costs_ms", _int_keyed(self.costs_ms, f"{where}.costs_ms"))
    if self.cold_start_block not in self.costs_ms:
      raise TablesError(f"{where}.cold_start_block {self.cold_start_block!r} is not among the cost blocks "
                        f"{list(self.costs_ms)}")
    for field in ("fixed_objectives", "shares"):
      if getattr(self, field) is not None:
        object.__setattr__(self, field, _int_keyed(getattr(self, field), f"{where}.{field}", False))

  def to_json(self) -> dict:
    out = {"concurrency": self.concurrency, "rho": self.rho, "cold_start_block": self.cold_start_block,
           "costs_ms": {str(b): t for b, t in self.costs_ms.items()}}
    if self.objective is not None:
      out["objective"] = self.objective
    for field in ("fixed_objectives", "shares"):
      if getattr(self, field) is not None:
        out[field] = {str(b): v for b, v in getattr(self, field).items()}
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class RecGuideTables:
  """RecGuide's fitted adaptive-B tables: value model + (rho, costs, cold start) per load level, and the overlap
  planner settings fitted for the checkpoint; frozen, versioned JSON."""
  value_model: vm.ValueModel
  levels: tuple[LevelTable, ...]
  profile: str
  version: str = ""  # empty: filled with a hash of the content
  notes: str = ""
  # the overlap planner's margin threshold fitted for this checkpoint (launch/fit_delta.py); None: the default
  overlap_delta: float | None = None
  overlap_planner: str = ""  # "no_p3" | "expected_hit" (launch/fit_delta.py); empty: the paper's rule
  overlap_slots: int | None = None  # branch slots of the fused tree (launch/fit_delta.py); None: the paper's 3
  # the expected-hit planner's prefix exponent gamma (launch/fit_delta.py); None: the plain product (1.0)
  overlap_prefix_exponent: float | None = None
  # the share of planned overlap rounds whose branch was reused, as the fitted planner measured it
  # (launch/fit_delta.py): the controller's prior for it (None: a generic prior)
  overlap_hit_rate: float | None = None
  # gamma with P(a draft accepted through token j) ~ (running product of its top probabilities through j)^gamma,
  # fitted on LinearSS rounds (launch/fit_verify_calibration.py): what verify truncation prices a token by
  verify_confidence_exponent: float | None = None

  def __post_init__(self):
    if not self.levels:
      raise TablesError("the tables need at least one concurrency level")
    levels = tuple(sorted(self.levels, key=lambda lv: lv.concurrency))
    seen = [lv.concurrency for lv in levels]
    if len(set(seen)) != len(seen):
      raise TablesError(f"levels repeat a concurrency: {seen}")
    for lv in levels:
      missing = [b for b in lv.costs_ms if b not in self.value_model.block_sizes]
      if missing:
        raise TablesError(f"levels[C={lv.concurrency}].costs_ms has block {missing[0]}, which the value model "
                          f"lacks (has {list(self.value_model.block_sizes)})")
    object.__setattr__(self, "levels", levels)
    if self.overlap_planner and self.overlap_planner not in PLANNERS:
      raise TablesError(f"overlap_planner must be one of {PLANNERS}, got {self.overlap_planner!r}")
    if self.overlap_delta is not None and not 0.0 <= self.overlap_delta <= 1.0:
      raise TablesError(f"overlap_delta must lie in [0, 1], got {self.overlap_delta}")
    if self.overlap_slots is not None and (isinstance(self.overlap_slots, bool) or
                                           not isinstance(self.overlap_slots, int) or
                                           not 1 <= self.overlap_slots <= MAX_SLOTS):
      raise TablesError(f"overlap_slots must be an integer in [1, {MAX_SLOTS}], got {self.overlap_slots!r}")
    if self.overlap_prefix_exponent is not None and not 0.0 < self.overlap_prefix_exponent <= 2.0:
      raise TablesError(f"overlap_prefix_exponent must lie in (0, 2], got {self.overlap_prefix_exponent}")
    if self.overlap_hit_rate is not None and not 0.0 <= self.overlap_hit_rate <= 1.0:
      raise TablesError(f"overlap_hit_rate must lie in [0, 1], got {self.overlap_hit_rate}")
    if self.verify_confidence_exponent is not None and not 0.0 < self.verify_confidence_exponent <= 2.0:
      raise TablesError(f"verify_confidence_exponent must lie in (0, 2], got {self.verify_confidence_exponent}")
    if not self.version:
      object.__setattr__(self, "version", self.content_hash())
    object.__setattr__(self, "_grid_rules", {})  # level C -> `decide_grid` of it, filled on first use
    object.__setattr__(self, "_level_at", {})  # load C -> the level it uses (every step asks, at a few loads)

  def grid_rule(self, c: float) -> tuple[LevelTable, np.ndarray]:
    """The level load `c` uses and its rule's block per row of the value model's grid (`decide_grid`)."""
    lv = self.level(c)
    rule = self._grid_rules.get(lv.concurrency)
    if rule is None:
      rule = self._grid_rules[lv.concurrency] = decide_grid(self.value_model, lv.rho, lv.costs_ms)
    return lv, rule

  @property
  def head_cap(self) -> int | None:
    """The e_t head cap the runtime must use in `round_entropy` (the one the signal was fitted with)."""
    return self.value_model.head_cap

  @property
  def concurrency_levels(self) -> tuple[int, ...]:
    return tuple(lv.concurrency for lv in self.levels)

  def level(self, c: float) -> LevelTable:
    lv = None if isinstance(c, bool) else self._level_at.get(c)  # (True == 1 as a key; `nearest_level` refuses it)
    if lv is None:
      target = nearest_level(c, self.concurrency_levels)
      lv = self._level_at[c] = next(lv for lv in self.levels if lv.concurrency == target)
    return lv

  def rho_for(self, c: float) -> float:
    return self.level(c).rho

  def costs_for(self, c: float) -> dict[int, float]:
    """The T_C(B) the level's rho was solved against (pair them: rho is a price in tokens per ms of these costs)."""
    return dict(self.level(c).costs_ms)

  def decide(self, c: float, s: float | None, z: str | None) -> int:
    lv = self.level(c)
    return decide(self.value_model, lv.rho, lv.costs_ms, s, z)

  def next_block(self, c: float, history: Sequence[sig.RoundRecord | Mapping]) -> int:
    """The block for a request's next round at load C: the cold-start block without history, else the rule."""
    lv = self.level(c)
    if not history:
      return lv.cold_start_block
    s = sig.signal_s(history, self.value_model.window)
    return decide(self.value_model, lv.rho, lv.costs_ms, s, sig.stratum(history))

  # ---- JSON --------------------------------------------------------------------------------------------------------
  def _payload(self) -> dict:
    out = {"profile": self.profile, "notes": self.notes, "levels": [lv.to_json() for lv in self.levels],
           "value_model": self.value_model.to_json()}
    if self.overlap_delta is not None:
      out["overlap_delta"] = self.overlap_delta
    if self.overlap_planner:
      out["overlap_planner"] = self.overlap_planner
    if self.overlap_slots is not None:
      out["overlap_slots"] = self.overlap_slots
    if self.overlap_prefix_exponent is not None:
      out["overlap_prefix_exponent"] = self.overlap_prefix_exponent
    if self.overlap_hit_rate is not None:
      out["overlap_hit_rate"] = self.overlap_hit_rate
    if self.verify_confidence_exponent is not None:
      out["verify_confidence_exponent"] = self.verify_confidence_exponent
    return out

  def content_hash(self) -> str:
    blob = json.dumps(self._payload(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]

  def to_json(self) -> dict:
    return {"schema": SCHEMA, "version": self.version, **self._payload()}

  @classmethod
  def from_json(cls, raw: Any, where: str = "tables") -> "RecGuideTables":
    if not isinstance(raw, Mapping):
      raise TablesError(f"{where}: the tables must be a JSON object")
    if raw.get("schema") != SCHEMA:
      raise TablesError(f"{where}: field 'schema' must be {SCHEMA!r}, got {raw.get('schema')!r}")
    for key in ("levels", "value_model", "profile"):
      if key not in raw:
        raise TablesError(f"{where}: missing field {key!r}")
    if not isinstance(raw["levels"], list):
      raise TablesError(f"{where}: field 'levels' must be a list")
    try:
      model = vm.ValueModel.from_json(raw["value_model"], f"{where}: value_model")
      levels = []
      for i, lv in enumerate(raw["levels"]):
        if not isinstance(lv, Mapping):
          raise TablesError(f"levels[{i}] must be an object")
        for key in ("concurrency", "rho", "costs_ms", "cold_start_block"):
          if key not in lv:
            raise TablesError(f"levels[{i}] is missing field {key!r}")
        levels.append(LevelTable(lv["concurrency"], lv["rho"], lv["costs_ms"], lv["cold_start_block"],
                                  lv.get("objective"), lv.get("fixed_objectives"), lv.get("shares")))
      delta = raw.get("overlap_delta")
      if delta is not None and (isinstance(delta, bool) or not isinstance(delta, (int, float))):
        raise TablesError(f"field 'overlap_delta' must be a number, got {delta!r}")
      planner = raw.get("overlap_planner", "")
      if not isinstance(planner, str):
        raise TablesError(f"field 'overlap_planner' must be a string, got {planner!r}")
      slots = raw.get("overlap_slots")
      if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int)):
        raise TablesError(f"field 'overlap_slots' must be an integer, got {slots!r}")
      numbers = {}
      for field in ("overlap_prefix_exponent", "overlap_hit_rate", "verify_confidence_exponent"):
        value = raw.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
          raise TablesError(f"field {field!r} must be a number, got {value!r}")
        numbers[field] = None if value is None else float(value)
      return cls(model, tuple(levels), str(raw["profile"]), str(raw.get("version", "")), str(raw.get("notes", "")),
                 None if delta is None else float(delta), planner, slots, **numbers)
    except (TablesError, vm.TraceError) as e:
      msg = str(e)
      raise TablesError(msg if msg.startswith(where) else f"{where}: {msg}") from None

  def save(self, path: str | os.PathLike) -> pathlib.Path:
    """Writes the JSON; a directory path (a checkpoint) gets `recguide_tables.json` inside it."""
    path = pathlib.Path(path)
    if path.is_dir():
      path = path / TABLES_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
    return path

  @classmethod
  def load(cls, path: str | os.PathLike) -> "RecGuideTables":
    return load_tables(path)


def tables_path(checkpoint_dir: str | os.PathLike) -> pathlib.Path | None:
  """The tables file a checkpoint directory ships (`recguide_tables.json`), or None."""
  path = pathlib.Path(checkpoint_dir) / TABLES_FILENAME
  return path if path.is_file() else None


def load_tables(path: str | os.PathLike) -> RecGuideTables:
  """Loads a tables JSON file, or the one a checkpoint directory ships (`tables_path`)."""
  path = pathlib.Path(path)
  if path.is_dir():
    path = tables_path(path) or path / TABLES_FILENAME
  if not path.is_file():
    raise TablesError(f"tables file {path} does not exist (fit one with launch/fit_tables.py)")
  try:
    raw = json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise TablesError(f"{path}: not valid JSON ({e})") from None
  return RecGuideTables.from_json(raw, str(path))

