import numpy as np

from recguide_jax.engine.books import DecodeBooks
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
    forwards = {"verify": np.ones(len(rows), np.int64), "draft": spec.astype(np.int64)}
    books.record(rows, block, accepted, rounds, forwards, spec)
    for i, row in enumerate(rows.tolist()):
      st = want.setdefault(row, RequestStats())
      st.rounds += rounds
      st.accepted_lengths.extend([int(accepted[i])] * rounds)
      st.block_sizes.extend([int(block[i])] * rounds)
      st.forwards["verify"] += 1
      st.forwards["draft"] += int(spec[i])
      if spec[i]:
        st.draft_tokens += int(block[i]) - 1
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
