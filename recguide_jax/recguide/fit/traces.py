"""RecGuide's shadow traces (offline): the row schema, its validation (errors name the field and file:line), reading
JSONL files, and the nested weights every fit and replay averages rows with.

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

import json
import math
import os
import pathlib
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from recguide_jax.recguide.signals import STRATA
from recguide_jax.recguide.value_model import TraceError


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
