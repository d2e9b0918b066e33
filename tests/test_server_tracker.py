"""server.tracker: the engine thread's updates reach the event loop in order, a burst for one wake-up."""

import asyncio
import threading

from recguide_jax.server.tracker import LoopOutbox


def test_a_burst_of_updates_costs_one_wakeup_of_the_loop_and_keeps_its_order():
  loop = asyncio.new_event_loop()
  wakeups = []
  real = loop.call_soon_threadsafe
  loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), real(*a))[1]
  outbox, got = LoopOutbox(loop), []
  try:
    # the loop is not running: the whole burst is posted before a delivery can take any of it
    done = threading.Event()
    def engine_thread():
      for i in range(100):
        outbox.post(got.append, i)
      done.set()
    threading.Thread(target=engine_thread).start()
    assert done.wait(10)
    assert len(wakeups) == 1 and got == []
    loop.run_until_complete(asyncio.sleep(0))
    assert got == list(range(100))
    # the next burst schedules its own delivery
    outbox.post(got.append, 100)
    outbox.post(got.append, 101)
    loop.run_until_complete(asyncio.sleep(0))
    assert got == list(range(102)) and len(wakeups) == 2
  finally:
    loop.close()


def test_a_failing_delivery_does_not_drop_the_others_and_a_closed_loop_takes_none():
  loop = asyncio.new_event_loop()
  outbox, got = LoopOutbox(loop), []
  outbox.post(got.append, 1)
  outbox.post(lambda: 1 / 0)
  outbox.post(got.append, 2)
  loop.run_until_complete(asyncio.sleep(0))
  assert got == [1, 2]
  loop.close()
  outbox.post(got.append, 3)  # nobody waits any more: no error, nothing kept
  outbox.post(got.append, 4)
  assert got == [1, 2] and not outbox._calls
