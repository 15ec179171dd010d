"""StepWatchdog: reports a step that runs past its bound, once."""

import threading
import time

from lingvo_gpipe.runners import train_loop


def testWatchdogReportsAStepPastItsBoundOnce():
  calls = []
  fired = threading.Event()

  def OnTimeout(step, elapsed, bound):
    del bound
    calls.append((step, elapsed))
    fired.set()

  dog = train_loop.StepWatchdog(
    0.2, OnTimeout, first_step_factor=1.0, poll_s=0.02
  )
  try:
    dog.StepStarted(1)  # a fast step: no report
    dog.StepFinished()
    time.sleep(0.3)
    assert not calls
    dog.StepStarted(2)  # a stuck step
    assert fired.wait(5)
    time.sleep(0.2)
    assert len(calls) == 1 and calls[0][0] == 2 and calls[0][1] > 0.2
  finally:
    dog.Stop()


def testFirstStepGetsALongerBound():
  calls = []
  dog = train_loop.StepWatchdog(
    0.1, lambda s, e, b: calls.append(s), first_step_factor=10.0, poll_s=0.02
  )
  try:
    dog.StepStarted(1)
    time.sleep(0.4)  # within 10 x 0.1 s
    dog.StepFinished()
    assert not calls
    dog.StepStarted(2)
    time.sleep(0.4)
    assert calls == [2]
  finally:
    dog.Stop()


def testAutoBoundFollowsTheMedianStepTime():
  calls = []
  dog = train_loop.StepWatchdog(
    None,
    lambda s, e, b: calls.append((s, b)),
    poll_s=0.02,
    min_timeout_s=0.3,
    median_factor=10.0,
    first_step_timeout_s=5.0,
  )
  try:
    assert dog.Bound() == 5.0  # Nothing measured: the first-step bound.
    for step in range(1, 6):
      dog.StepStarted(step)
      time.sleep(0.01 if step > 1 else 0.1)
      dog.StepFinished()
    assert 0.005 < dog.Median() < 0.1
    assert dog.Bound() == max(0.3, 10 * dog.Median())
    dog.StepStarted(6)  # A stuck step ends within the bound.
    deadline = time.time() + 5
    while not calls and time.time() < deadline:
      time.sleep(0.02)
    assert calls and calls[0][0] == 6 and calls[0][1] < 1.1
  finally:
    dog.Stop()
