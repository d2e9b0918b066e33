import collections
import threading

import numpy as np

from recguide_jax.engine.books import DecodeBooks, RoundTally
from recguide_jax.engine.requests import RequestStats


def test_books_match_the_per_request_bookkeeping_they_replace():
  """Random rounds over random batches of table rows: what `close` writes equals stats kept round by round."""
  rng = np.random.default_rng(0)
  books, want = DecodeBooks(), {}
  for _ in range(60):
    rows = rng.choice(40, size=rng.integers(1, 12), replace=False)
    rounds = int(rng.choice([1, 4]))
    block = rng.choice([1, 8, 16, 32], size=len(rows))
    accepted = np.minimum(rng.integers(1, 34, size=len(rows)), block + 1)
    spec = block > 1
    # half the rounds' verifies truncated: draft tokens are the ones offered to the verifier
    verified = np.minimum(block, rng.integers(1, 33, size=len(rows))) if rng.random() < 0.5 else None
    offered = block if verified is None else verified
    forwards = {"verify": np.ones(len(rows), np.int64), "draft": spec.astype(np.int64)}
    books.record(rows, block, accepted, rounds, forwards, spec, verified)
    for i, row in enumerate(rows.tolist()):
      st = want.setdefault(row, RequestStats())
      st.rounds += rounds
      st.accepted_lengths.extend([int(accepted[i])] * rounds)
      st.block_sizes.extend([int(block[i])] * rounds)
      st.forwards["verify"] += 1
      st.forwards["draft"] += int(spec[i])
      if spec[i]:
        st.draft_tokens += int(offered[i]) - 1
        st.accepted_draft_tokens += int(accepted[i]) - 1
  for row, st in want.items():
    got = RequestStats()
    got.forwards["prefill"] = st.forwards["prefill"] = 1  # counted by the prefill, before: kept
    books.close(row, got)
    assert got == st
    again = RequestStats()
    books.close(row, again)  # closed books are empty: the row's next request starts from zero
    assert again == RequestStats()
  books.close(10_000, RequestStats())  # a row never recorded


def _tally_rounds(seed: int, n: int):
  rng = np.random.default_rng(seed)
  for _ in range(n):
    size = int(rng.integers(0, 12))
    rounds = int(rng.choice([1, 4]))
    block = rng.choice([1, 8, 16, 32], size=size)
    accepted = np.minimum(rng.integers(1, 34, size=size), block + 1)
    verified = np.minimum(block, rng.integers(1, 33, size=size)) if rng.random() < 0.3 else None
    yield block, accepted, rounds, (block > 1 if rng.random() < 0.7 else None), verified


def test_the_round_tally_folds_to_the_counters_of_each_round_alone():
  """Rounds of random rows, folded at every read and every few rounds: the counters each round would have added
  (block sizes run, verified drafts, draft and accepted draft tokens, drafts accepted at least k far)."""
  totals = collections.Counter()
  tally = RoundTally(totals, fold_every=5)
  want_totals, want_pos, want_blocks = collections.Counter(), collections.Counter(), collections.Counter()
  for i, (block, accepted, rounds, spec, verified) in enumerate(_tally_rounds(0, 60)):
    tally.add(block, accepted, rounds, spec, verified)
    for b, a in zip(block.tolist(), accepted.tolist()):
      want_blocks[b] += rounds
    if spec is not None:
      offered = block if verified is None else verified  # a truncated verify offers fewer drafts
      for b, a in zip(offered[spec].tolist(), accepted[spec].tolist()):
        want_totals["drafts"] += 1
        want_totals["draft_tokens"] += b - 1
        want_totals["accepted_draft_tokens"] += a - 1
        for pos in range(1, a):
          want_pos[pos] += 1
    if i % 7 == 0:
      tally.fold()
      assert (totals, tally.per_position, tally.block_sizes) == (want_totals, want_pos, want_blocks)
  tally.fold()
  assert (totals, tally.per_position, tally.block_sizes) == (want_totals, want_pos, want_blocks)
  assert want_totals["drafts"] and want_pos[3]


def test_a_fold_on_another_thread_loses_no_round():
  """A metrics scrape folds on its own thread while the engine adds rounds and folds on its own."""
  rounds = list(_tally_rounds(1, 3000))
  totals = collections.Counter()
  tally = RoundTally(totals, fold_every=4)
  stop = threading.Event()

  def scrape():
    while not stop.is_set():
      tally.fold()

  scraper = threading.Thread(target=scrape)
  scraper.start()
  try:
    for r in rounds:
      tally.add(*r)
  finally:
    stop.set()
    scraper.join()
  tally.fold()
  assert sum(tally.block_sizes.values()) == sum(len(b) * n for b, _, n, _, _ in rounds)
  assert totals["accepted_draft_tokens"] == sum(int(a[s].sum()) - int(s.sum()) for _, a, _, s, _ in rounds
                                                if s is not None)


def test_request_stats_as_dict_is_its_fields_copied_with_the_derived_values():
  import dataclasses
  stats = RequestStats(rounds=3, accepted_lengths=[1, 4, 2], block_sizes=[1, 8, 8], draft_tokens=14,
                       accepted_draft_tokens=4, ttft_s=0.5, latency_s=1.5, queue_s=0.1)
  stats.forwards["verify"] = 2
  stats.forwards["prefill"] = 1
  d = stats.as_dict()
  assert d == {**dataclasses.asdict(stats), "decode_forwards": 2, "mean_accepted_length": 7 / 3}
  d["accepted_lengths"].append(9)
  d["block_sizes"].clear()
  d["forwards"]["verify"] = 0
  assert stats.accepted_lengths == [1, 4, 2] and stats.block_sizes == [1, 8, 8] and stats.forwards["verify"] == 2
  assert RequestStats().as_dict()["mean_accepted_length"] == 0.0
