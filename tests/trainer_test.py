"""End-to-end tests of the trainer binary on the tiny digits model.

Most tests run `python -m lingvo_gpipe.trainer` in a subprocess (the CPU is
split into 2 devices there, as a user would), each bounded by a timeout and
killed on failure. One training run (30 steps, K=2 cells) is shared by the
tests that only read its logdir; tests that write copy it first.
"""

import glob
import logging as std_logging
import os
import random
import shutil
import signal
import time

import numpy as np
import pytest
import tensorflow as tf

from tensorflow.core.util import event_pb2

from lingvo_gpipe import model_registry
from lingvo_gpipe import trainer
from lingvo_gpipe import trainer_errors
from lingvo_gpipe.runners import checkpointer
from lingvo_gpipe.runners import evaler
from tests.testing import trainer_process


def _Steps(train_dir):
  return [s for s, _ in checkpointer.ListCheckpoints(str(train_dir))]


def _Tags(directory):
  """{tag: [steps]} of the TensorBoard events in `directory`."""
  tags = {}
  for path in glob.glob(os.path.join(str(directory), 'events.out.tfevents.*')):
    for record in tf.data.TFRecordDataset(path):
      event = event_pb2.Event.FromString(record.numpy())
      for value in event.summary.value:
        tags.setdefault(value.tag, []).append(event.step)
  return tags


def _Copy(src, dst):
  shutil.copytree(src, dst)
  return dst


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """Trains 30 steps in K=2 cells, saving every 10 steps; evals alongside."""
  logdir = tmp_path_factory.mktemp('trained') / 'logdir'
  res = trainer_process.Run(
    f'--logdir={logdir}',
    '--max_steps=30',
    '--log_interval_steps=10',
    '--job=trainer,evaler_dev',
    '--eval_interval_seconds=0.1',
    '--model_params_override=task.train.save_interval_steps : 10',
  )
  assert res.returncode == 0, res.stderr[-3000:]
  return logdir, res.stderr


def testTrainWritesParamsCheckpointsEvents(trained):
  logdir, log = trained
  text = (logdir / 'params.txt').read_text()
  assert 'task.train.max_steps : 30' in text
  assert 'task.train.save_interval_steps : 10' in text
  assert _Steps(logdir / 'train') == [10, 20, 30]
  tags = _Tags(logdir / 'train')
  for tag in (
    'loss',
    'learning_rate',
    'grad_norm',
    'accuracy',
    'examples_per_sec',
    'step_time',
  ):
    assert 20 in tags.get(tag, []) and 30 in tags[tag], (tag, tags)
  assert 'cell 1 on /device:CPU:1' in log  # Placement logged at start.
  # The evaler thread evaluated the final checkpoint, then the process ended.
  records = evaler.ReadResults(evaler.EvalDir(str(logdir), 'dev'))
  assert records and records[-1]['step'] == 30
  assert 30 in _Tags(logdir / 'eval_dev')['accuracy']
  progress = [ln for ln in log.splitlines() if 'step      30/30' in ln][0]
  assert 'loss' in progress and 'examples/s' in progress
  assert 'ms/step' in progress and 'ETA' in progress
  # Quiet: no TensorFlow start-up banner, no saver timing at each checkpoint.
  for noise in (
    'oneDNN custom operations',
    'absl::InitializeLog()',
    'Sharding callback duration',
  ):
    assert noise not in log, noise


def testOneLineStripsTheFramesOfTracing(tmp_path):
  # What tf.function raises for an error in the traced code.
  traced = ValueError(
    'in user code:\n\n    File "/x/model.py", line 3, in FProp  *\n'
    '        raise ValueError(\n\n    ValueError: dim=5 does not match\n'
    '    the input width 4\n'
  )
  assert (
    trainer.OneLine(traced, is_user_error=True)
    == 'dim=5 does not match     the input width 4'
  )
  assert trainer.OneLine(trainer.UserError('a\nb')) == 'a b'
  # Unexpected: its first line, and the traceback in the logdir.
  line = trainer.OneLine(traced, str(tmp_path))
  assert line == (
    'ValueError: dim=5 does not match (traceback in '
    f'{tmp_path / "error_traceback.txt"})'
  )
  error = trainer_errors.BuildError('building the model', traced)
  assert isinstance(error, trainer.UserError)
  assert str(error) == (
    'dim=5 does not match     the input width 4 (while building the model)'
  )


class _DyingCluster:
  """A remote cluster whose worker 1 stops accepting connections only on
  the third look (its process is still being torn down)."""

  is_remote = True

  def __init__(self):
    self.looks = 0

  def UnreachableWorkers(self):
    self.looks += 1
    return ['/job:worker/task:1 (127.0.0.1:1)'] if self.looks >= 3 else []


def testWorkerLostDuringTheRestoreIsNamedWithTheLikelyCause(tmp_path):
  error = tf.errors.UnavailableError(
    None, None, 'failed to connect to all addresses'
  )
  cluster = _DyingCluster()
  cluster.looks = 5
  with pytest.raises(trainer.UserError) as info:
    trainer_errors.RaiseIfWorkerLost(
      error, str(tmp_path), cluster, during='the restore of the checkpoint'
    )
  message = str(info.value)
  assert message.startswith(
    'Lost worker /job:worker/task:1 (127.0.0.1:1) during the restore of the '
    'checkpoint'
  ), message
  assert 'out-of-memory killer' in message and 'UnavailableError' in message


def testWorkerLostAMomentAfterTheStepFailedIsNamed(tmp_path, monkeypatch):
  cluster = _DyingCluster()
  error = tf.errors.InternalError(None, None, '2 root error(s) found.')
  with pytest.raises(
    trainer.UserError, match=r'Lost worker /job:worker/task:1 .*InternalError'
  ):
    trainer_errors.RaiseIfWorkerLost(error, str(tmp_path), cluster)
  assert cluster.looks == 3
  # An error of a cluster whose workers are all there passes on (after the
  # grace period).
  monkeypatch.setattr(trainer_errors, '_LOST_WORKER_GRACE_S', 0.3)
  cluster.looks = -100
  trainer_errors.RaiseIfWorkerLost(error, str(tmp_path), cluster)


def testSetUpLoggingDropsTensorFlowNoiseOnly():
  records = []

  class Keep(std_logging.Handler):
    def emit(self, record):
      records.append(record.getMessage())

  handler = Keep()
  logger = tf.get_logger()
  logger.addHandler(handler)
  try:
    trainer.SetUpLogging()
    trainer.SetUpLogging()  # Idempotent: one filter.
    logger.warning('default session config: device_count {')
    logger.warning('Sharding callback duration: 12 microseconds')
    logger.warning('Saved checkpoint /tmp/x/ckpt-1 in 0.1s.')
  finally:
    logger.removeHandler(handler)
  assert records == ['Saved checkpoint /tmp/x/ckpt-1 in 0.1s.']
  assert (
    sum(isinstance(f, type(trainer_errors._DROP_NOISE)) for f in logger.filters)
    == 1
  )


def testResumeContinuesFromSavedStep(trained, tmp_path):
  logdir = _Copy(trained[0], tmp_path / 'logdir')
  res = trainer_process.Run(f'--logdir={logdir}', '--max_steps=40')
  assert res.returncode == 0, res.stderr[-3000:]
  assert 'Restored ' + str(logdir / 'train' / 'ckpt-30') in res.stderr
  assert 'step      40/40' in res.stderr
  assert _Steps(logdir / 'train')[-1] == 40
  # 30 steps + restart + 10 steps == 40 steps straight: same global step,
  # optimizer slots and input position were restored.
  p = model_registry.GetParams(trainer_process.MODEL, 'Train')
  model = p.Instantiate()
  task = model.GetTask()
  step = tf.function(task.TrainStep, autograph=False)
  it = iter(task.input_generator.GetDataset())
  for _ in range(40):
    step(next(it))
  reader = tf.train.load_checkpoint(str(logdir / 'train' / 'ckpt-40'))
  variables = model.VariablesByName()
  assert any(name.endswith('/m') for name in variables)  # Adam slots.
  for name, var in variables.items():
    np.testing.assert_allclose(
      reader.get_tensor(checkpointer.VariableKey(name)),
      var.numpy(),
      rtol=1e-4,
      atol=1e-6,
      err_msg=name,
    )


def testUnknownModelListsCloseKeys():
  res = trainer_process.Run(
    '--mode=inspect_params', model='image.digits.MlpDigitTiny'
  )
  assert res.returncode == 1
  assert "No model registered under 'image.digits.MlpDigitTiny'" in res.stderr
  assert 'image.digits.MlpDigitsTiny' in res.stderr
  assert 'Traceback' not in res.stderr


def testBadOverrideNamesTheKey(tmp_path):
  res = trainer_process.Run(
    '--mode=inspect_params',
    '--model_params_override=task.train.learning_rat : 0.1',
  )
  assert res.returncode == 1
  assert "unknown parameter 'task.train.learning_rat'" in res.stderr
  assert "did you mean 'task.train.learning_rate'" in res.stderr
  assert 'Traceback' not in res.stderr


@pytest.mark.parametrize(
  'override,expected',
  [
    (
      'task.network.num_micro_batches : 5',
      "ERROR: Pipeline 'digits/network': num_micro_batches=5 does not "
      'divide the batch size 64',
    ),
    (
      # Without input_shapes the first batch's shapes are checked.
      'task.network.input_shapes : None; task.network.layers[2].input_dim : 16',
      "ERROR: Pipeline 'digits/network' cell 1 (fc1) cannot take the output "
      'of cell 0 (flatten, fc0), of shapes [64, 64]: its first layer fc1 '
      '(ProjectionLayer) says: ',
    ),
  ],
)
def testModelErrorsAreOneLinePrintedOnce(tmp_path, override, expected):
  res = trainer_process.Run(
    f'--logdir={tmp_path}',
    '--max_steps=2',
    f'--model_params_override={override}',
  )
  assert res.returncode == 1
  assert 'Traceback' not in res.stderr
  errors = [
    ln
    for ln in res.stderr.splitlines()
    if 'num_micro_batches=5' in ln or ('cannot take' in ln)
  ]
  assert len(errors) == 1, res.stderr[-3000:]
  assert errors[0].startswith(expected), errors[0]


def testLogdirOverridesAreTheTrainingOverrides():
  train = model_registry.GetParams(trainer_process.MODEL, 'Train')
  trained = train.Copy()
  trained.task.train.max_steps = 7
  trained.task.network.num_micro_batches = 2
  trained.task.network.devices = ['/device:CPU:0', '/device:CPU:1']
  trained.task.network.num_stages = 2
  trained.input.batch_size = 32
  text = trainer.LogdirOverrides(train, trained.ToText())
  assert sorted(text.splitlines()) == [
    'task.network.num_micro_batches : 2',
    'task.train.max_steps : 7',
  ]
  p = trainer.BuildParams(
    trainer_process.MODEL, 'Dev', logdir_params=trained.ToText()
  )
  assert p.task.train.max_steps == 7 and p.task.network.devices is None
  assert (
    p.input.batch_size
    == model_registry.GetParams(trainer_process.MODEL, 'Dev').input.batch_size
  )


def testParamsOverridesInProcess(tmp_path):
  override_file = tmp_path / 'override.txt'
  override_file.write_text(
    'task.train.learning_rate : 0.5\n# a comment\ntask.train.max_steps : 7\n'
  )
  p = trainer.BuildParams(
    trainer_process.MODEL,
    'Train',
    str(override_file),
    ['task.train.max_steps : 9; task.softmax.input_dim : 64'],
    worker_split_size=1,
    seed=77,
    max_to_keep=2,
  )
  assert p.task.train.learning_rate == 0.5
  assert p.task.train.max_steps == 9  # Flag lines win over the file.
  assert p.task.train.save_max_to_keep == 2
  assert p.random_seed == 77 and p.task.random_seed == 77
  assert p.task.network.num_stages == 1
  assert len(p.task.network.devices) == 1
  with pytest.raises(
    trainer.UserError,
    match="Line 1: cannot parse 'abc' for parameter 'task.train.max_steps'",
  ):
    trainer.BuildParams(
      trainer_process.MODEL, 'Train', overrides=['task.train.max_steps : abc']
    )
  with pytest.raises(trainer.UserError, match='No such file'):
    trainer.BuildParams(
      trainer_process.MODEL, 'Train', file_override=str(tmp_path / 'none')
    )
  with pytest.raises(
    trainer.UserError, match='--worker_split_size=9 needs 9 devices but only'
  ):
    trainer.BuildParams(trainer_process.MODEL, 'Train', worker_split_size=9)
  with pytest.raises(trainer.UserError, match='unknown job'):
    trainer.ParseJobs('trainer,evaler')
  jobs = trainer.ParseJobs('trainer_client, evaler_dev')
  assert jobs == [('trainer', None), ('evaler', 'Dev')]


def testInspectModelInProcess():
  p = trainer.BuildParams(trainer_process.MODEL, 'Train', worker_split_size=2)
  text = trainer.InspectModel(p.Instantiate())
  assert 'digits/network/fc0/w ' in text and 'Adam/iterations' in text
  assert 'parameters' in text and 'global_step' in text
  assert 'cell 0 on' in text and 'cell 1 on' in text


def testK2CheckpointRestoresIntoK1(trained, tmp_path):
  logdir = _Copy(trained[0], tmp_path / 'logdir')
  shutil.rmtree(logdir / 'eval_dev')
  res = trainer_process.Run(
    f'--logdir={logdir}',
    '--job=evaler_dev',
    '--worker_split_size=1',
    '--max_steps=30',
    '--eval_interval_seconds=0.1',
    '--eval_timeout=60',
  )
  assert res.returncode == 0, res.stderr[-3000:]
  assert "Pipeline 'digits/network': 1 cells" in res.stderr
  (k1,) = evaler.ReadResults(evaler.EvalDir(str(logdir), 'dev'))
  assert k1['step'] == 30
  # The same checkpoint evaluated by the training run, in K=2 cells.
  k2 = evaler.ReadResults(evaler.EvalDir(str(trained[0]), 'dev'))[-1]
  assert k2['step'] == 30
  assert abs(k1['metrics']['loss'] - k2['metrics']['loss']) < 1e-5
  assert k1['metrics']['accuracy'] == pytest.approx(k2['metrics']['accuracy'])


def testIncompatibleCheckpointIsRefused(trained, tmp_path):
  logdir = _Copy(trained[0], tmp_path / 'logdir')
  before = sorted(os.listdir(logdir / 'train'))
  params_before = (logdir / 'params.txt').read_text()
  res = trainer_process.Run(
    f'--logdir={logdir}', model='image.digits.MlpDigitsTinyBN'
  )
  assert res.returncode == 1
  assert 'was written by a different model' in res.stderr
  assert 'moving_mean' in res.stderr or 'beta' in res.stderr
  assert 'with another shape or dtype' in res.stderr
  assert '--restore_from' in res.stderr
  assert sorted(os.listdir(logdir / 'train')) == before
  assert (logdir / 'params.txt').read_text() == params_before


def testEvalerErrorsAreNamedAlone(tmp_path):
  res = trainer_process.Run(f'--logdir={tmp_path}', '--job=evaler_devv')
  assert res.returncode == 1, res.stderr[-3000:]
  line = trainer_process.ErrorLine(res.stderr)
  assert line.startswith(
    "ERROR: evaler_devv: MlpDigitsTiny has no dataset 'Devv'; available: "
  ), line


def testEvalerErrorNextToATrainerStopsItAndLosesNothing(trained, tmp_path):
  logdir = _Copy(trained[0], tmp_path / 'logdir')
  before = sorted(os.listdir(logdir / 'train'))
  res = trainer_process.Run(
    f'--logdir={logdir}', '--job=trainer,evaler_devv', '--max_steps=100000'
  )
  assert res.returncode == 1, res.stderr[-3000:]
  line = trainer_process.ErrorLine(res.stderr)
  assert line.startswith('ERROR: evaler_devv: MlpDigitsTiny has no dataset')
  assert 'Training stopped at step 30 (evaler_devv failed)' in res.stderr
  assert set(before) <= set(os.listdir(logdir / 'train'))
  assert trainer_process.Latest(logdir / 'train') == 30


def testResumeWithOtherParamsIsRefusedUnlessAllowed(trained, tmp_path):
  logdir = _Copy(trained[0], tmp_path / 'logdir')
  params = (logdir / 'params.txt').read_text()
  files = sorted(os.listdir(logdir / 'train'))
  args = (
    f'--logdir={logdir}',
    '--max_steps=35',
    '--worker_split_size=1',  # Placement may change: not named.
    '--model_params_override=task.train.learning_rate : 0.002',
  )
  res = trainer_process.Run(*args)
  assert res.returncode == 1, res.stderr[-3000:]
  line = trainer_process.ErrorLine(res.stderr)
  assert line == (
    f'ERROR: {logdir}/train/ckpt-30 was trained with other Params than '
    f'these ({logdir}/params.txt): task.train.learning_rate 0.001 -> 0.002. '
    'To resume it as trained, rerun with the same overrides '
    "(--model_params_override='task.train.learning_rate : 0.001'); to train "
    'on with the new Params, pass --allow_params_change (params.txt is left '
    'as it was).'
  )
  assert (logdir / 'params.txt').read_text() == params
  assert sorted(os.listdir(logdir / 'train')) == files
  res = trainer_process.Run(*args, '--allow_params_change')
  assert res.returncode == 0, res.stderr[-3000:]
  assert 'allowed by --allow_params_change' in res.stderr
  assert (
    'task.train.learning_rate : 0.002' in (logdir / 'params.txt').read_text()
  )
  assert trainer_process.Latest(logdir / 'train') == 35


def testTruncatedLatestCheckpointIsSetAsideAndTheOneBeforeResumes(
  trained, tmp_path
):
  logdir = _Copy(trained[0], tmp_path / 'logdir')
  data = logdir / 'train' / 'ckpt-30.data-00000-of-00001'
  with open(data, 'r+b') as f:
    f.truncate(1000)
  res = trainer_process.Run(f'--logdir={logdir}', '--max_steps=35')
  assert res.returncode == 0, res.stderr[-3000:]
  aside = logdir / 'train' / 'broken' / 'ckpt-30'
  (line,) = [ln for ln in res.stderr.splitlines() if 'truncated' in ln]
  assert line.endswith(
    f'Checkpoint {logdir}/train/ckpt-30 is truncated or corrupt: {data} '
    '(1000 bytes): shorter than its index says (truncated). Set it aside '
    f'as {aside}; resuming from the checkpoint before it.'
  ), line
  assert f'Resumed from {logdir}/train/ckpt-20, the newest' in res.stderr
  assert os.path.getsize(f'{aside}.data-00000-of-00001') == 1000
  assert os.path.exists(f'{aside}.index')
  assert _Steps(logdir / 'train') == [10, 20, 35]
  assert 'ERROR' not in res.stderr


def testALogdirHasOneTrainer(tmp_path):
  logdir = tmp_path / 'logdir'
  train_dir = logdir / 'train'
  first = trainer_process.Proc(
    tmp_path / 'log.txt',
    f'--logdir={logdir}',
    '--max_steps=100000',
    '--model_params_override=task.train.save_interval_steps : 20',
  )
  try:
    first.WaitFor(lambda: trainer_process.Latest(train_dir) >= 20)
    first.proc.send_signal(signal.SIGSTOP)  # Alive, and leaves the CPU.
    params = (logdir / 'params.txt').read_text()
    res = trainer_process.Run(f'--logdir={logdir}', '--max_steps=5')
    assert res.returncode == 1, res.stderr[-3000:]
    line = trainer_process.ErrorLine(res.stderr)
    pid = first.proc.pid
    assert line.startswith(
      f'ERROR: --logdir {logdir} belongs to another trainer: pid {pid} on host '
    ), line
    assert line.endswith(
      f'still running. Stop it (kill {pid}) or pass another --logdir.'
    ), line
    assert first.proc.poll() is None
    assert (logdir / 'params.txt').read_text() == params
    # An evaler only reads the logdir: it may share it.
    res = trainer_process.Run(
      f'--logdir={logdir}', '--job=evaler_dev', '--max_steps=20'
    )
    assert res.returncode == 0, res.stderr[-3000:]
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=30)
  finally:
    first.Close()
  step = trainer_process.Latest(train_dir)
  res = trainer_process.Run(f'--logdir={logdir}', f'--max_steps={step + 2}')
  assert res.returncode == 0, res.stderr[-3000:]
  assert f'Taking over {logdir} from a trainer that is gone: pid {pid}' in (
    res.stderr
  )
  assert trainer_process.Latest(train_dir) == step + 2
  assert not (logdir / 'trainer.lock').exists()  # Released at exit.


def testStandaloneEvalerOnAnEmptyLogdirEnds(tmp_path):
  # The default bound ends: a mistyped --logdir never waits forever.
  assert 0 < trainer.FLAGS['eval_idle_timeout_s'].default <= 3600
  res = trainer_process.Run(
    f'--logdir={tmp_path}',
    '--job=evaler_dev',
    '--eval_idle_timeout_s=1',
    '--eval_interval_seconds=0.2',
  )
  assert res.returncode == 1, res.stderr[-3000:]
  train_dir = tmp_path / 'train'
  assert (
    f'Eval dev: no checkpoint in {train_dir} yet and no trainer runs '
    'there; waiting for one (1 s, --eval_idle_timeout_s).'
  ) in res.stderr
  assert trainer_process.ErrorLine(res.stderr) == (
    f'ERROR: evaler_dev: No checkpoint in {train_dir} after 1 s, and no '
    'trainer runs there. Check --logdir, start the trainer, or wait longer '
    'with --eval_idle_timeout_s (0: no limit).'
  )


def testNanLossStopsAndKeepsLastGoodCheckpoint(tmp_path):
  logdir = tmp_path / 'logdir'
  res = trainer_process.Run(
    f'--logdir={logdir}',
    '--max_steps=50',
    '--model_params_override=task.train.learning_rate : 1e30',
    '--model_params_override=task.train.save_interval_steps : 1',
  )
  assert res.returncode == 1, res.stderr[-3000:]
  line = [ln for ln in res.stderr.splitlines() if ln.startswith('ERROR:')][0]
  assert 'at step' in line and (
    'loss is nan' in line
    or 'loss is inf' in line
    or 'NaN or Inf' in line
    or 'weights diverged' in line
  )
  bad_step = int(line.split('at step ')[1].split()[0].rstrip('.;:'))
  latest = checkpointer.LatestCheckpoint(str(logdir / 'train'))
  # At lr 1e30 the weights diverge at once, so no checkpoint is kept.
  assert latest is None or checkpointer.StepOf(latest) < bad_step
  if latest is not None:
    reader = tf.train.load_checkpoint(latest)
    for key, dtype in reader.get_variable_to_dtype_map().items():
      if dtype.is_floating:
        assert np.all(np.isfinite(reader.get_tensor(key))), key


def testSigtermSavesAndExitsZero(tmp_path):
  logdir = tmp_path / 'logdir'
  proc = trainer_process.Proc(
    tmp_path / 'log.txt',
    f'--logdir={logdir}',
    '--max_steps=100000',
    '--log_interval_steps=5',
    '--model_params_override=task.train.save_interval_steps : 100000',
  )
  try:
    proc.WaitFor(lambda: 'examples/s' in proc.Log())
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=60) == 0, proc.Log()[-3000:]
  finally:
    proc.Close()
  assert 'SIGTERM received' in proc.Log()
  latest = checkpointer.LatestCheckpoint(str(logdir / 'train'))
  assert latest is not None and checkpointer.StepOf(latest) >= 5


def testSigkillThenRestartResumesWithoutCorruption(tmp_path):
  logdir = tmp_path / 'logdir'
  train_dir = logdir / 'train'
  rng = random.Random()
  delays, last = [], -1
  for i in range(2):
    proc = trainer_process.Proc(
      tmp_path / f'log{i}.txt',
      f'--logdir={logdir}',
      '--max_steps=100000',
      '--model_params_override=task.train.save_interval_steps : 1',
      '--saver_max_to_keep=2',
    )
    try:
      proc.WaitFor(lambda last=last: trainer_process.Latest(train_dir) > last)
      delays.append(rng.uniform(0.0, 0.3))
      time.sleep(delays[-1])
      proc.proc.send_signal(signal.SIGKILL)
      proc.proc.wait(timeout=30)
    finally:
      proc.Close()
    latest = checkpointer.LatestCheckpoint(str(train_dir))
    assert latest is not None, delays
    step = checkpointer.StepOf(latest)
    assert step > last, (delays, step, last)
    reader = tf.train.load_checkpoint(latest)  # Every tensor reads back.
    for key, dtype in reader.get_variable_to_dtype_map().items():
      if dtype != tf.variant:  # The input position: not readable as numpy.
        reader.get_tensor(key)
    if i:
      assert 'Restored ' in proc.Log(), delays
    last = step
  res = trainer_process.Run(
    f'--logdir={logdir}',
    f'--max_steps={last + 3}',
    '--model_params_override=task.train.save_interval_steps : 1',
  )
  assert res.returncode == 0, (delays, res.stderr[-3000:])
  assert 'Restored ' in res.stderr, delays
  assert _Steps(train_dir)[-1] == last + 3
  assert not glob.glob(str(train_dir / '*_temp'))


def testFineTuneFromAnotherLogdir(trained, tmp_path):
  logdir = tmp_path / 'logdir'
  source = trained[0] / 'train' / 'ckpt-30'
  res = trainer_process.Run(
    f'--logdir={logdir}',
    '--max_steps=2',
    f'--restore_from={trained[0]}',
    r'--restore_map=digits/network/(.*)=>digits/network/\1',
    r'--restore_map=digits/softmax/(.*)=>digits/softmax/\1',
  )
  assert res.returncode == 0, res.stderr[-3000:]
  assert f'variables from {source}:' in res.stderr
  assert 'digits/network/fc0/w <- digits/network/fc0/w' in res.stderr
  assert 'global_step: never restored when fine-tuning' in res.stderr
  assert 'Adam/iterations: no --restore_map rule matches it' in res.stderr
  new = tf.train.load_checkpoint(str(logdir / 'train' / 'ckpt-2'))
  old = tf.train.load_checkpoint(str(source))
  assert new.get_tensor(checkpointer.VariableKey('global_step')) == 2
  names = [
    n
    for n in checkpointer.ReadCheckpointVariables(str(source))
    if n.startswith('digits/network/') and n.endswith('/w')
  ]
  assert names
  for name in names:  # Two Adam steps of 1e-3 away from the source.
    key = checkpointer.VariableKey(name)
    assert np.abs(new.get_tensor(key) - old.get_tensor(key)).max() < 0.01


def testExportModeWritesASavedmodel(trained, tmp_path):
  export_dir = tmp_path / 'export'
  res = trainer_process.Run(
    f'--logdir={trained[0]}', '--mode=export', f'--export_dir={export_dir}'
  )
  assert res.returncode == 0, res.stderr[-3000:]
  model = model_registry.GetParams(trainer_process.MODEL, 'Test').Instantiate()
  checkpointer.Checkpointer(
    str(trained[0] / 'train'), model.VariablesByName(), writable=False
  ).RestoreFrom(str(trained[0] / 'train' / 'ckpt-30'))
  task = model.GetTask()
  batch = next(iter(task.input_generator.GetDataset()))
  expected = task.Decode(batch).logits.numpy()
  loaded = tf.saved_model.load(str(export_dir))
  out = loaded.signatures['serving_default'](image=batch.image)
  np.testing.assert_allclose(
    out['logits'].numpy(), expected, rtol=1e-5, atol=1e-6
  )


def testAutoStagesAndMicroBatchesResolvedAtBuild():
  p = trainer.BuildParams(
    trainer_process.MODEL,
    'Train',
    overrides=[
      "task.network.num_stages : 'auto'; task.network.num_micro_batches : auto",
      'task.network.planner_memory_per_device : 150000',
    ],
    devices=[f'/device:CPU:{i}' for i in range(4)],
  )
  net = p.task.network
  assert net.num_stages == 'auto' and net.num_micro_batches == 'auto'
  assert len(net.devices) == 4
  # The batch of the training input fills the planner's input shape.
  assert net.input_shapes[0][0] == p.input.batch_size
  text = trainer.PlacementText(p.Instantiate())
  assert 'planned (num_stages=auto, num_micro_batches=auto' in text
  # 150 kB per device cannot hold the weights, gradients and Adam slots of
  # all the layers (about 190 KiB): more than one cell.
  assert 'cell 1 on' in text


class _LostOnRestore:
  def Restore(self):
    raise tf.errors.UnavailableError(None, None, 'failed to connect')


def testRestoreNamesAWorkerLostWhileReading(tmp_path):
  cluster = _DyingCluster()
  cluster.looks = 5
  with pytest.raises(trainer.UserError, match='during the restore of the'):
    trainer_errors.Restore(_LostOnRestore(), str(tmp_path), cluster)


def testTrainerRunsAreForkedFromAWarmTrainer(tmp_path):
  """The tests' trainer runs fork from one warm trainer process (the same
  binary and flags, its own pid and exit status, without importing
  TensorFlow again), unless LINGVO_GPIPE_TEST_FORK=0."""
  if os.environ.get('LINGVO_GPIPE_TEST_FORK', '1') == '0':
    pytest.skip('LINGVO_GPIPE_TEST_FORK=0: runs start fresh processes.')
  proc = trainer_process.Proc(
    tmp_path / 'log.txt', f'--logdir={tmp_path / "logdir"}', '--max_steps=1'
  )
  try:
    with open(f'/proc/{proc.proc.pid}/stat') as f:
      parent = int(f.read().rsplit(')', 1)[1].split()[1])
    assert parent == trainer_process.Server()._proc.pid  # pylint: disable=protected-access
    assert proc.proc.wait(timeout=60) == 0, proc.Log()[-3000:]
  finally:
    proc.Close()
  res = trainer_process.Run('--mode=inspect_params', model='image.nope')
  assert res.returncode == 1 and "No model registered under 'image.nope'" in (
    res.stderr
  )
