"""RecGuide's per-request histories as arrays: rows handed out and taken back, rounds appended as one scatter, the
value model's grid rows of them equal to what each history gives alone, and states moving between strategies."""

import types

import numpy as np

from recguide_jax import SamplingParams
from recguide_jax.recguide import signals
from recguide_jax.recguide.config import HISTORY, RecGuideState
from recguide_jax.recguide.controller import RecGuideStrategy
from recguide_jax.recguide.histories import Histories
from recguide_jax.recguide.signals import RoundRecord


def random_history(rng) -> list[RoundRecord]:
  out = []
  for _ in range(int(rng.integers(0, HISTORY + 3))):
    blk = int(rng.choice([1, 8, 16, 32]))
    out.append(RoundRecord(blk, int(rng.integers(1, blk + 1)),
                           None if blk == 1 or rng.random() < 0.2 else float(rng.random() * 3)))
  return out


def test_rows_are_reused_and_grow_keeping_what_they_hold():
  h = Histories(capacity=4)
  rng = np.random.default_rng(0)
  held = {}
  for _ in range(40):  # more requests than rows at first, joining and leaving at random
    if held and rng.random() < 0.4:
      row = list(held)[int(rng.integers(len(held)))]
      h.release(row)
      del held[row]
    else:
      records = random_history(rng)
      row = h.allocate(records)
      assert row not in held
      held[row] = records[-HISTORY:]
  assert h.in_use == len(held) and h.capacity >= len(held) + 1
  for row, records in held.items():
    assert h.records(row) == records
    assert h.ar_tail[row] == next((i for i, r in enumerate(reversed(records)) if r.block_size > 1), len(records))


def test_append_is_one_round_at_a_time_for_each_row():
  rng = np.random.default_rng(1)
  h = Histories(capacity=2)
  lists = [random_history(rng) for _ in range(9)]
  rows = np.array([h.allocate(r) for r in lists])
  for step in range(6):
    times = int(rng.integers(1, 3))
    pick = np.flatnonzero(rng.random(len(rows)) < 0.6)
    blocks = rng.choice([1, 8, 16], len(pick))
    accepted = np.array([rng.integers(1, b + 1) for b in blocks])
    entropy = np.where(blocks > 1, rng.random(len(pick)), np.nan)
    h.append(rows[pick], blocks, accepted, entropy, times=times)
    for i, b, a, e in zip(pick.tolist(), blocks.tolist(), accepted.tolist(), entropy.tolist()):
      lists[i] = (lists[i] + [RoundRecord(b, a, None if b == 1 else e)] * times)[-HISTORY:]
  for row, records in zip(rows.tolist(), lists):
    assert h.records(row) == records[-HISTORY:]
    want_tail = next((i for i, r in enumerate(reversed(records)) if r.block_size > 1), None)
    assert want_tail is None or h.ar_tail[row] == want_tail


def test_grid_rows_are_each_historys_own_and_kept_until_it_moves():
  from recguide_jax.recguide.adaptive import load_tables
  from recguide_jax.llm import BUNDLED_CHECKPOINT
  import os
  model = load_tables(os.path.join(BUNDLED_CHECKPOINT, "recguide_tables.json")).value_model
  rng = np.random.default_rng(2)
  h = Histories()
  lists = [random_history(rng) for _ in range(50)]
  rows = np.array([h.allocate(r) for r in lists])

  def alone(hist):
    return model.grid_row(*((signals.signal_s(hist, model.window), signals.stratum(hist)) if hist else (None, None)))
  assert h.grid_rows(rows, model).tolist() == [alone(r) for r in lists]
  assert (h.grid_row[rows] >= 0).all()
  h.append(rows[:3], 16, 16, 0.25)  # three histories move: their rows are read again, the others' kept
  assert (h.grid_row[rows[:3]] < 0).all() and (h.grid_row[rows[3:]] >= 0).all()
  assert h.grid_rows(rows, model).tolist() == [alone(h.records(r)) for r in rows.tolist()]


def test_a_state_joins_a_strategy_leaves_with_its_history_and_moves_to_another():
  req = types.SimpleNamespace(strategy_state=RecGuideState([RoundRecord(8, 3, 0.5)]),
                              params=SamplingParams(max_tokens=64), output_ids=[], finished=False)
  one, two = RecGuideStrategy(16), RecGuideStrategy(16)
  state = one.state(req)
  assert state.histories is one.histories and one.histories.in_use == 1
  assert state.history == [RoundRecord(8, 3, 0.5)]
  state.prefetched = "branch"
  two.state(req)  # another RecGuide strategy reads it: it moves, history and branch
  assert one.histories.in_use == 0 and two.histories.in_use == 1
  assert state.history == [RoundRecord(8, 3, 0.5)] and state.prefetched == "branch"
  two.on_finish(req)
  assert two.histories.in_use == 0 and state.history == [RoundRecord(8, 3, 0.5)] and state.prefetched == "branch"
  # its last round is observed after it finished (and a pipelined call's row after that): it is lent a row for the
  # observation, observed as while running, and the row goes back
  result = types.SimpleNamespace(tokens=np.full((1, 8), 7), entropy=np.full((1, 8), 0.5, np.float32))
  two.observe_verification(req, 8, 2, result, 0)
  assert two.histories.in_use == 0 and state.histories is None and state.prefetched is None
  assert state.history == [RoundRecord(8, 3, 0.5), RoundRecord(8, 2, 0.5)]


def test_prefetched_branches_are_read_and_dropped_by_row():
  h = Histories(capacity=4)
  rows = np.array([h.allocate() for _ in range(6)])
  h.prefetched[int(rows[1])] = types.SimpleNamespace(tokens=[3] * 8)
  h.prefetched[int(rows[4])] = types.SimpleNamespace(tokens=[3] * 16)
  assert h.held_lengths(rows).tolist() == [0, 8, 0, 0, 16, 0]
  h.drop_prefetched(rows[:3])  # a verification of the first three: rows[1]'s branch goes, rows[4]'s stays
  assert list(h.prefetched) == [int(rows[4])] and h.held_lengths(rows[3:]).tolist() == [0, 16, 0]
