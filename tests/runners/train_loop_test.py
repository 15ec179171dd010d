"""The train loop: it stops on a non-finite loss keeping the last good model,
ends on a stop request, and its StepWatchdog reports a step that runs past its
bound, once."""

import threading
import time

import pytest
import tensorflow as tf

from lingvo_gpipe import model_registry
from lingvo_gpipe.runners import checkpointer
from lingvo_gpipe.runners import train_loop
from tests.testing import trainer_process


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


def testTrainLoopInProcessNanHookAndStop(tmp_path):
  model = model_registry.GetParams(trainer_process.MODEL, 'Train').Instantiate()
  task = model.GetTask()
  it = iter(task.input_generator.GetDataset())
  ckpt = checkpointer.Checkpointer(
    str(tmp_path / 'train'),
    model.VariablesByName(),
    iterator=it,
    save_interval_steps=1,
  )

  def NanAtStep6(batch):  # The test hook: a NaN loss from step 6 on.
    out = task.TrainStep(batch)
    out.loss = tf.where(model.global_step >= 6, float('nan'), out.loss)
    return out

  loop = train_loop.TrainLoop(
    task,
    model.global_step,
    it,
    ckpt,
    max_steps=10,
    summary_dir=str(tmp_path / 'train'),
    train_step_fn=NanAtStep6,
  )
  with pytest.raises(
    train_loop.NonFiniteError, match='loss is nan at step 6.*last good model'
  ):
    loop.Run()
  # ckpt-5 held the weights that gave the NaN at step 6: removed.
  assert trainer_process.Latest(tmp_path / 'train') == 4
  assert not (tmp_path / 'train' / 'ckpt-5.index').exists()
  # A stop request ends the loop before the next step; nothing new to save.
  stop = train_loop.StopRequest()
  stop.Set('SIGTERM')
  model2 = model_registry.GetParams(
    trainer_process.MODEL, 'Train'
  ).Instantiate()
  ckpt2 = checkpointer.Checkpointer(
    str(tmp_path / 'train'), model2.VariablesByName()
  )
  ckpt2.Restore()
  result = train_loop.TrainLoop(
    model2.GetTask(), model2.global_step, it, ckpt2, max_steps=10, stop=stop
  ).Run()
  assert (result.step, result.reason) == (4, 'SIGTERM')
  assert result.checkpoint.endswith('ckpt-4')


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
