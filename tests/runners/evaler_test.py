"""Tests of the evaler job, in process, on the tiny digits model."""

import json
import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_model
from lingvo_gpipe.runners import checkpointer
from lingvo_gpipe.runners import evaler
from lingvo_gpipe.runners import trainer_state

MODEL = 'image.digits.MlpDigitsTiny'


@pytest.fixture(scope='module')
def logdir(tmp_path_factory):
  """A logdir whose train/ holds ckpt-3 and ckpt-6 of a short training."""
  out = tmp_path_factory.mktemp('evaler') / 'logdir'
  model = model_registry.GetParams(MODEL, 'Train').Instantiate()
  task = model.GetTask()
  step = tf.function(task.TrainStep, autograph=False)
  it = iter(task.input_generator.GetDataset())
  ckpt = checkpointer.Checkpointer(str(out / 'train'), model.VariablesByName())
  for i in range(1, 7):
    step(next(it))
    if i % 3 == 0:
      ckpt.Save(i)
  return out


def _Dev(max_steps=6):
  p = model_registry.GetParams(MODEL, 'Dev')
  p.task.train.max_steps = max_steps
  return p


def testEvaluatesLatestCheckpointOnceAndRecords(logdir, tmp_path):
  ev = evaler.Evaler(_Dev(), str(logdir), dataset='Dev', interval_seconds=0.05)
  records = ev.Run()
  assert [r['step'] for r in records] == [6]
  rec = records[0]
  assert rec['dataset'] == 'dev' and rec['checkpoint'].endswith('ckpt-6')
  assert rec['weights']['loss'] == 180.0  # The whole dev set, padding out.
  assert rec['metrics']['num_preds'] == 180.0  # A count: summed.
  assert 0.0 <= rec['metrics']['accuracy'] <= 1.0
  assert ev.eval_dir == os.path.join(str(logdir), 'eval_dev')
  assert evaler.ReadResults(ev.eval_dir) == records
  assert any(
    f.startswith('events.out.tfevents') for f in os.listdir(ev.eval_dir)
  )
  # The same numbers as a plain one-pass MetricsAggregator.
  model = _Dev().Instantiate()
  checkpointer.Checkpointer(
    str(logdir / 'train'), model.VariablesByName(), writable=False
  ).RestoreFrom(rec['checkpoint'])
  task = model.GetTask()
  eval_step = tf.function(task.EvalStep, autograph=False)
  agg = base_model.MetricsAggregator()
  for batch in task.input_generator.GetDataset():
    agg.Update(eval_step(batch))
  for name, value in agg.Result().items():
    assert rec['metrics'][name] == pytest.approx(value, rel=1e-5), name
  # A restarted evaler does not evaluate step 6 again.
  again = evaler.Evaler(_Dev(), str(logdir), interval_seconds=0.05)
  assert again.Run() == []


def testOlderCheckpointAndTimeout(logdir, tmp_path):
  ev = evaler.Evaler(
    _Dev(max_steps=100),
    str(tmp_path / 'out'),
    dataset='test',
    train_dir=str(logdir / 'train'),
    interval_seconds=0.05,
    timeout_seconds=0.3,
  )
  rec = ev.EvalCheckpoint(str(logdir / 'train' / 'ckpt-3'))
  assert rec['step'] == 3 and rec['dataset'] == 'test'
  start = time.time()
  records = ev.Run()  # Evaluates ckpt-6, then times out waiting for step 100.
  assert [r['step'] for r in records] == [6]
  assert time.time() - start < 10
  assert [r['step'] for r in evaler.ReadResults(ev.eval_dir)] == [3, 6]


def testStopRequestAndNewCheckpoints(logdir, tmp_path):
  train_dir = tmp_path / 'train'
  model = model_registry.GetParams(MODEL, 'Train').Instantiate()
  ckpt = checkpointer.Checkpointer(str(train_dir), model.VariablesByName())
  ckpt.Save(1)

  class Stop:
    requested = False

  stop = Stop()
  ev = evaler.Evaler(_Dev(max_steps=2), str(tmp_path), interval_seconds=0.05)
  result = []
  thread = threading.Thread(target=lambda: result.extend(ev.Run(stop=stop)))
  thread.start()
  deadline = time.time() + 60
  while not evaler.ReadResults(ev.eval_dir) and time.time() < deadline:
    time.sleep(0.05)
  ckpt.Save(2)  # The final step: the evaler evaluates it and returns.
  thread.join(timeout=60)
  stop.requested = True
  assert not thread.is_alive()
  assert [r['step'] for r in result] == [1, 2]


def testInfiniteInputIsRefused(tmp_path):
  p = model_registry.GetParams(MODEL, 'Train')  # num_epochs=None.
  with pytest.raises(ValueError, match='repeats forever'):
    evaler.Evaler(p, str(tmp_path))


def testIncompatibleCheckpointIsAnError(tmp_path):
  variables = {'other/w': tf.Variable(1.0)}
  checkpointer.Checkpointer(str(tmp_path / 'train'), variables).Save(1)
  ev = evaler.Evaler(_Dev(max_steps=1), str(tmp_path), interval_seconds=0.05)
  with pytest.raises(checkpointer.IncompatibleCheckpointError, match='digits/'):
    ev.Run()


def testDecoderSavesPredictions(logdir, tmp_path):
  dec = evaler.Decoder(
    _Dev(),
    str(tmp_path),
    dataset='dev',
    train_dir=str(logdir / 'train'),
    interval_seconds=0.05,
  )
  assert dec.eval_dir == str(tmp_path / 'decoder_dev')
  (record,) = dec.Run()
  assert record['step'] == 6 and record['metrics']['num_examples'] == 180
  with np.load(record['decoder_out']) as out:
    assert out['logits'].shape == (180, 10)  # Padding left out.
    assert out['label'].shape == (180,)


def testStandaloneEvalerEndsOnceTheTrainerHasExited(logdir, tmp_path, caplog):
  train_dir = tmp_path / 'train'
  model = model_registry.GetParams(MODEL, 'Train').Instantiate()
  checkpointer.Checkpointer(str(train_dir), model.VariablesByName()).Save(2)

  def Evaler(**kwargs):
    return evaler.Evaler(
      _Dev(max_steps=100),
      str(tmp_path),
      interval_seconds=0.05,
      until_trainer_exits=True,
      **kwargs,
    )

  # A running trainer (this process): it waits (here until the timeout).
  evaler.WriteTrainerState(str(train_dir), running=True)
  assert evaler.TrainerRunning(str(train_dir))
  start = time.time()
  assert [r['step'] for r in Evaler(timeout_seconds=0.5).Run()] == [2]
  assert time.time() - start >= 0.5
  # The trainer has stopped at step 2, short of max_steps=100: it ends.
  evaler.WriteTrainerState(str(train_dir), running=False, step=2)
  assert not evaler.TrainerRunning(str(train_dir))
  with caplog.at_level(logging.INFO):
    assert Evaler().Run() == []
  # Already evaluated: it shows the latest results it has.
  text = '\n'.join(r.getMessage() for r in caplog.records)
  assert 'Eval dev at step 2 (evaluated before' in text
  assert 'accuracy ' in text


def testTrainerRunningIsFalseForADeadProcess(tmp_path):
  proc = subprocess.Popen([sys.executable, '-c', 'pass'])
  proc.wait()
  evaler.WriteTrainerState(str(tmp_path), running=True)
  path = tmp_path / evaler.TRAINER_STATE_FILE
  state = json.loads(path.read_text())
  state['pid'] = proc.pid
  path.write_text(json.dumps(state))
  assert not evaler.TrainerRunning(str(tmp_path))
  assert not evaler.TrainerRunning(str(tmp_path / 'nothing'))
  # Killed: its state says running, its process is gone.
  assert trainer_state.KilledTrainer(str(tmp_path))['pid'] == proc.pid
  assert trainer_state.KilledTrainer(str(tmp_path / 'nothing')) is None
  evaler.WriteTrainerState(str(tmp_path), running=True)  # This process.
  assert trainer_state.KilledTrainer(str(tmp_path)) is None
  evaler.WriteTrainerState(str(tmp_path), running=False, step=3)
  assert trainer_state.KilledTrainer(str(tmp_path)) is None
