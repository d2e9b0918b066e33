"""Hardware profile T_C(B): draft + verify milliseconds for a full bucket of C requests at block size B
(docs/spec/recguide.md §5.3), plus the optional single-forward costs the regime switch needs (AR step, fused
verify+branches).

JSON schema "recguide-profile/1" (keys of the ms maps are decimal strings; all ms values finite and > 0):

  {
    "schema": "recguide-profile/1",
    "name": "b200_nld8b",                     # optional; how `load_profile` finds shipped profiles
    "source": "...", "backend": "...", "device": "...", "model": "...", "notes": "...",
    "draft_verify_ms": {"<C>": {"<B>": ms, ...}, ...},   # required; every C row has the same B columns
    "ar_step_ms": {"<C>": ms},                           # optional: one AR decode token for a full bucket of C
    "fused_ms": {"<C>": {"<B>": ms}},                    # optional: one fused verify+branches forward (~4B queries)
    "draft_ms": {"<C>": {"<B>": ms}},                    # optional split of draft_verify_ms
    "verify_ms": {"<C>": {"<B>": ms}}
  }

Costs between measured C are interpolated linearly and clamped outside the measured range (a bucket smaller than
the smallest measured one is not cheaper than it, and we refuse to extrapolate growth past the largest).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
import os
import pathlib
import types
from typing import Any, Mapping

import numpy as np

# the fused forward that fused_ms measures: the paper's tree of 3 branch slots (4B query tokens)
from recguide_jax.recguide.overlap import MAX_BRANCHES as FUSED_SLOTS

SCHEMA = "recguide-profile/1"
PROFILE_DIR = "profiles"
_GRIDS = ("draft_verify_ms", "fused_ms", "draft_ms", "verify_ms")
_TEXT = ("name", "source", "backend", "device", "model", "notes")


class ProfileError(ValueError):
  """A profile file is malformed or a cost was asked outside what it holds; the message names the field."""


def _positive_int_key(key: Any, field: str) -> int:
  if isinstance(key, bool):
    raise ProfileError(f"{field}: key {key!r} is not a positive integer")
  if isinstance(key, int):
    value = key
  elif isinstance(key, str) and key.strip().isdigit():
    value = int(key)
  else:
    raise ProfileError(f"{field}: key {key!r} is not a positive integer")
  if value <= 0:
    raise ProfileError(f"{field}: key {key!r} must be positive")
  return value


def _ms(value: Any, field: str) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
    raise ProfileError(f"{field} must be a finite number of milliseconds > 0, got {value!r}")
  return float(value)


def _parse_row(raw: Any, field: str) -> Mapping[int, float]:
  if not isinstance(raw, Mapping) or not raw:
    raise ProfileError(f"{field} must be a non-empty object keyed by batch size C")
  out = {}
  for key, value in raw.items():
    c = _positive_int_key(key, field)
    out[c] = _ms(value, f"{field}[{c}]")
  return types.MappingProxyType(dict(sorted(out.items())))


def _parse_grid(raw: Any, field: str) -> Mapping[int, Mapping[int, float]]:
  if not isinstance(raw, Mapping) or not raw:
    raise ProfileError(f"{field} must be a non-empty object {{C: {{B: ms}}}}")
  out, columns = {}, None
  for key, row in raw.items():
    c = _positive_int_key(key, field)
    if not isinstance(row, Mapping) or not row:
      raise ProfileError(f"{field}[{c}] must be a non-empty object {{B: ms}}")
    parsed = {}
    for bkey, value in row.items():
      b = _positive_int_key(bkey, f"{field}[{c}]")
      parsed[b] = _ms(value, f"{field}[{c}][{b}]")
    cols = tuple(sorted(parsed))
    if columns is None:
      columns = cols
    elif cols != columns:
      # interpolating across C needs the same B columns in every row
      raise ProfileError(f"{field}[{c}] has block sizes {list(cols)}, other rows have {list(columns)}")
    out[c] = types.MappingProxyType(dict(sorted(parsed.items())))
  return types.MappingProxyType(dict(sorted(out.items())))


def _interp(row: Mapping[int, float], c: float) -> float:
  levels = np.fromiter(row.keys(), float)
  return float(np.interp(float(c), levels, np.fromiter(row.values(), float)))


@dataclasses.dataclass(frozen=True, eq=False)
class HardwareProfile:
  draft_verify_ms: Mapping[int, Mapping[int, float]]
  source: str = ""
  backend: str = ""
  device: str = ""
  model: str = ""
  notes: str = ""
  name: str = ""
  ar_step_ms: Mapping[int, float] | None = None
  fused_ms: Mapping[int, Mapping[int, float]] | None = None
  draft_ms: Mapping[int, Mapping[int, float]] | None = None
  verify_ms: Mapping[int, Mapping[int, float]] | None = None

  def __post_init__(self):
    # normalise (and validate) whatever mappings the caller passed into read-only {int: ...} maps
    for field in _GRIDS:
      value = getattr(self, field)
      if value is not None or field == "draft_verify_ms":
        object.__setattr__(self, field, _parse_grid(value, field))
    if self.ar_step_ms is not None:
      object.__setattr__(self, "ar_step_ms", _parse_row(self.ar_step_ms, "ar_step_ms"))
    for field in _TEXT:
      if not isinstance(getattr(self, field), str):
        raise ProfileError(f"{field} must be a string, got {getattr(self, field)!r}")
    if (self.draft_ms is None) != (self.verify_ms is None):
      raise ProfileError("draft_ms and verify_ms must be given together (they split draft_verify_ms)")

  # ---- shape ---------------------------------------------------------------------------------------------------
  @property
  def levels(self) -> tuple[int, ...]:
    """The measured batch sizes C."""
    return tuple(self.draft_verify_ms)

  @property
  def block_sizes(self) -> tuple[int, ...]:
    return tuple(next(iter(self.draft_verify_ms.values())))

  @property
  def fused_estimated(self) -> bool:
    """True when `fused_cost` extrapolates from T_C(32)/T_C(8) instead of a measured fused forward."""
    return self.fused_ms is None

  @property
  def ar_estimated(self) -> bool:
    """True when `ar_cost` is estimated as one forward at the smallest block (an upper bound)."""
    return self.ar_step_ms is None

  # ---- costs -----------------------------------------------------------------------------------------------------
  def _check_c(self, c: float) -> None:
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0:
      raise ProfileError(f"batch size C must be a positive number, got {c!r}")

  def _grid_cost(self, grid: Mapping[int, Mapping[int, float]], field: str, c: float, b: int) -> float:
    self._check_c(c)
    first = next(iter(grid.values()))
    if b not in first:
      raise ProfileError(f"{field} has no block size {b} (profile {self.name or self.source!r} measures "
                         f"{list(first)})")
    return _interp({level: row[b] for level, row in grid.items()}, c)

  def cost(self, c: float, b: int) -> float:
    """T_C(B): draft + verify ms per round for a full bucket of C requests at block B."""
    return self._grid_cost(self.draft_verify_ms, "draft_verify_ms", c, b)

  def costs(self, c: float, block_sizes: tuple[int, ...] | None = None) -> dict[int, float]:
    """{B: T_C(B)} for the profile's block sizes (or the given ones)."""
    return {b: self.cost(c, b) for b in (block_sizes or self.block_sizes)}

  def forward_costs(self, c: float, b: int) -> tuple[float, float]:
    """(draft ms, verify ms) of one round. Without a measured split, half of T_C(B) each: the B200 notes find the
    two forwards nearly equal (docs/spec/recguide.md §7.6)."""
    if self.draft_ms is not None:
      return (self._grid_cost(self.draft_ms, "draft_ms", c, b), self._grid_cost(self.verify_ms, "verify_ms", c, b))
    half = self.cost(c, b) / 2
    return half, half

  def ar_cost(self, c: float) -> float:
    """One AR decode token for a full bucket of C (launch/profile.py times the engine's multi-step decode call and
    divides by its steps; profiles before it timed a single-step call). Estimated, when not measured, as the verify
    forward at the smallest block: at serving sizes a forward is weight-bound, so 1 vs B query tokens barely
    differ."""
    if self.ar_step_ms is not None:
      self._check_c(c)
      return _interp(self.ar_step_ms, c)
    return self.forward_costs(c, self.block_sizes[0])[1]

  def ragged_cost(self, c: float, tokens: int, draft: bool) -> float:
    """One ragged forward (runtime/steps.py) of `c` rows holding `tokens` packed query tokens, rows at blocks of
    their own: the profile's draft (`draft`) or verify forward of c rows at the mean block tokens / c, linear
    between the measured blocks. It charges the tokens the forward computes, with no padding row and no second
    forward for a second block size; the largest measured block bounds it above. Below the smallest block (AR rows,
    truncated verifies) a verify is linear down to the measured AR step at one token per row, which never costs more
    than the smallest block (a profile whose AR step was slower, as h200's at C = 1, is weight-bound there: flat);
    without a measured AR step it is the smallest block's cost (`ar_cost`'s estimate)."""
    self._check_c(c)
    blocks = self.block_sizes
    role = 0 if draft else 1
    costs = [self.forward_costs(c, b)[role] for b in blocks]
    mean = tokens / c
    if mean < blocks[0] and not draft and self.ar_step_ms is not None:
      floor = min(self.ar_cost(c), costs[0])
      return float(np.interp(mean, (1.0, float(blocks[0])), (floor, costs[0])))
    mean = min(max(mean, blocks[0]), blocks[-1])
    return float(np.interp(mean, np.asarray(blocks, float), np.asarray(costs)))

  def fused_cost(self, c: float, b: int, slots: int = FUSED_SLOTS) -> float:
    """One fused verify + prospective-branch forward at block B with `slots` branch slots ((1 + slots) B query
    tokens per request, docs/spec/recguide.md §6); profiles hold the paper's tree of 3 slots (4B query tokens).

    When not measured: the verify forward at B scaled by T_C(4·b0)/T_C(b0) for the smallest block b0 whose 4x is
    also measured (T_C(32)/T_C(8) on the 8/16/32 grid), i.e. the cost of 4x query tokens per request at the same C;
    `fused_estimated` says so. Other slot counts: linear in the branch slots between the verify forward (0 slots)
    and the 3-slot tree, the cost of a compute-bound device (an upper bound where query tokens are nearly free)."""
    if slots < 1:
      raise ProfileError(f"a fused forward has at least one branch slot, got {slots}")
    if self.fused_ms is not None:
      tree = self._grid_cost(self.fused_ms, "fused_ms", c, b)
    else:
      base = next((x for x in self.block_sizes if 4 * x in self.block_sizes), None)
      if base is None:
        raise ProfileError(f"cannot estimate fused_ms: the profile needs blocks B and 4B (has "
                           f"{list(self.block_sizes)}); measure fused_ms with launch/profile.py")
      tree = self.forward_costs(c, b)[1] * self.cost(c, 4 * base) / self.cost(c, base)
    if slots == FUSED_SLOTS:
      return tree
    verify = self.forward_costs(c, b)[1]
    return verify + (tree - verify) * slots / FUSED_SLOTS

  # ---- JSON --------------------------------------------------------------------------------------------------------
  def to_json(self) -> dict:
    out: dict[str, Any] = {"schema": SCHEMA}
    for field in _TEXT:
      out[field] = getattr(self, field)
    for field in ("draft_verify_ms", "ar_step_ms", "fused_ms", "draft_ms", "verify_ms"):
      value = getattr(self, field)
      if value is None:
        continue
      out[field] = {str(c): ({str(b): ms for b, ms in row.items()} if isinstance(row, Mapping) else row)
                    for c, row in value.items()}
    return out

  @classmethod
  def from_json(cls, raw: Any, where: str = "profile") -> "HardwareProfile":
    if not isinstance(raw, Mapping):
      raise ProfileError(f"{where}: a profile must be a JSON object")
    if raw.get("schema") != SCHEMA:
      raise ProfileError(f"{where}: field 'schema' must be {SCHEMA!r}, got {raw.get('schema')!r}")
    known = {"schema", "draft_verify_ms", "ar_step_ms", "fused_ms", "draft_ms", "verify_ms", *_TEXT}
    unknown = sorted(set(raw) - known)
    if unknown:
      raise ProfileError(f"{where}: unknown field {unknown[0]!r} (known: {sorted(known)})")
    if "draft_verify_ms" not in raw:
      raise ProfileError(f"{where}: missing required field 'draft_verify_ms'")
    try:
      return cls(**{k: v for k, v in raw.items() if k != "schema"})
    except ProfileError as e:
      raise ProfileError(f"{where}: {e}") from None

  def save(self, path: str | os.PathLike) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _shipped_dir():
  return importlib.resources.files("recguide_jax.recguide") / PROFILE_DIR


def available_profiles() -> tuple[str, ...]:
  """Names of the profiles shipped with the package (loadable with `load_profile(name)`)."""
  return tuple(sorted(p.name[:-5] for p in _shipped_dir().iterdir() if p.name.endswith(".json")))


def load_profile(path_or_name: str | os.PathLike) -> HardwareProfile:
  """Loads a profile JSON from a path, or a shipped profile by name (e.g. "b200_nld8b")."""
  path = pathlib.Path(path_or_name)
  if path.is_file():
    text, where = path.read_text(), str(path)
  else:
    name = str(path_or_name)
    shipped = _shipped_dir() / f"{name}.json"
    if os.sep in name or not shipped.is_file():
      raise ProfileError(f"no profile file {str(path_or_name)!r} and no shipped profile of that name "
                         f"(shipped: {', '.join(available_profiles())})")
    text, where = shipped.read_text(), f"shipped profile {name}"
  try:
    raw = json.loads(text)
  except json.JSONDecodeError as e:
    raise ProfileError(f"{where}: not valid JSON ({e})") from None
  return HardwareProfile.from_json(raw, where)
