"""StepWatchdog: reports a step that runs past its bound, once."""

import threading
import time

from lingvo_gpipe.runners import train_loop


def testWatchdogReportsAStepPastItsBoundOnce():
  calls = []
  fired = threading.Event()

  def OnTimeout(step, elapsed):
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
    0.1, lambda s, e: calls.append(s), first_step_factor=10.0, poll_s=0.02
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
