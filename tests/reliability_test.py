"""Faults and bad data through the trainer binary (docs/reliability.md).

Each test runs `python -m lingvo_gpipe.trainer` (or a small program) in a
subprocess on tiny generated ImageNet-format TFRecords, bounded by a
timeout, and checks the exit status, the one-line message and that nothing
hangs.
"""

import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.input import imagenet
from lingvo_gpipe.runners import checkpointer
from tests.testing import trainer_process
from tests.testing import warm_python

REPO = pathlib.Path(__file__).resolve().parents[1]
MODEL = 'image.imagenet.MlpImageNetTiny'
TIMEOUT = 150


def _Example(encoded, label=None):
  feature = {
    imagenet.IMAGE_KEY: tf.train.Feature(
      bytes_list=tf.train.BytesList(value=[encoded])
    )
  }
  if label is not None:
    feature[imagenet.LABEL_KEY] = tf.train.Feature(
      int64_list=tf.train.Int64List(value=[label])
    )
  return tf.train.Example(
    features=tf.train.Features(feature=feature)
  ).SerializeToString()


def _Write(path, records):
  with tf.io.TFRecordWriter(str(path)) as w:
    for r in records:
      w.write(r)
  return str(path)


def _Good(path, n=40, seed=0):
  rs = np.random.RandomState(seed)
  return _Write(
    path,
    [
      _Example(
        tf.io.encode_jpeg(rs.randint(0, 256, [10, 12, 3], np.uint8)).numpy(),
        1 + i % 10,
      )
      for i in range(n)
    ],
  )


def _Env():
  return warm_python.ServerEnv()


def _Cmd(logdir, files, *args):
  return [
    sys.executable,
    '-m',
    'lingvo_gpipe.trainer',
    f'--model={MODEL}',
    '--num_cpu_devices=2',
    '--run_locally=cpu',
    f'--logdir={logdir}',
    f'--model_params_override=input.file_pattern : {files}',
    *args,
  ]


def _Train(logdir, files, *args, timeout=TIMEOUT):
  return warm_python.Run(
    _Cmd(logdir, files, *args),
    cwd=REPO,
    env=_Env(),
    timeout=timeout,
  )


def _ErrorLine(res):
  """The one ERROR line (and no traceback) of a failed run."""
  lines = [ln for ln in res.stderr.splitlines() if ln.startswith('ERROR:')]
  assert len(lines) == 1, res.stderr[-3000:]
  assert 'Traceback' not in res.stderr, res.stderr[-3000:]
  return lines[0]


def testDamagedFileExitsWithOneLineNamingIt(tmp_path):
  path = _Good(tmp_path / 'train-0')
  data = bytearray(open(path, 'rb').read())
  data[len(data) // 2] ^= 0xFF
  with open(path, 'wb') as f:
    f.write(bytes(data))
  res = _Train(
    tmp_path / 'logdir',
    path,
    '--max_steps=20',
    "--model_params_override=input.corrupt_records : 'error'",
  )
  assert res.returncode == 1, res.stderr[-3000:]
  line = _ErrorLine(res)
  assert f'{path}: damaged TFRecord data at byte offset' in line, line
  assert "skip corrupt records with input.corrupt_records : 'skip'" in line


@pytest.mark.slow
@pytest.mark.parametrize('case', ['garbage', 'no_label', 'not_example'])
def testBadFilesExitWithOneLine(tmp_path, case):
  path = str(tmp_path / 'train-0')
  if case == 'garbage':
    with open(path, 'wb') as f:
      f.write(np.random.RandomState(0).bytes(5000))
    want = 'this file is not a TFRecord of tf.train.Example'
  elif case == 'no_label':
    _Write(path, [_Example(b'x')] * 4)
    want = 'lacks the feature "image/class/label"'
  else:
    _Write(path, [b'\xff\xfeplain text'] * 4)
    want = 'is not a tf.train.Example'
  res = _Train(
    tmp_path / 'logdir',
    path,
    '--max_steps=20',
    "--model_params_override=input.corrupt_records : 'error'",
  )
  assert res.returncode == 1, res.stderr[-3000:]
  line = _ErrorLine(res)
  assert path in line and want in line, line


@pytest.mark.slow
def testSkippingAllBadRecordsStops(tmp_path):
  path = _Write(
    tmp_path / 'train-0', [_Example(b'bad %d' % i, 1) for i in range(50)]
  )
  start = time.time()
  res = _Train(
    tmp_path / 'logdir',
    path,
    '--max_steps=20',
    '--model_params_override=input.max_corrupt_records : 30',
  )
  assert res.returncode == 1, res.stderr[-3000:]
  assert time.time() - start < TIMEOUT
  line = _ErrorLine(res)
  assert '31 of the 31 records read are corrupt' in line, line
  assert res.stderr.count('skipping a corrupt record') <= 20 + 5


@pytest.mark.slow
def testEvalerErrorEndsTheProcess(tmp_path):
  train = _Good(tmp_path / 'train-0')
  bad = _Write(tmp_path / 'validation-0', [_Example(b'x')] * 4)
  res = _Train(
    tmp_path / 'logdir',
    train,
    '--max_steps=100000',
    '--job=trainer,evaler_dev',
    '--eval_interval_seconds=1',
    f'--model_params_override=input.eval_file_pattern : {bad}',
    '--model_params_override=task.train.save_interval_steps : 20',
  )
  assert res.returncode == 1, res.stderr[-3000:]
  line = _ErrorLine(res)
  assert line.startswith('ERROR: evaler_dev: ImageNetInput: ' + bad), line


def _Weights(prefix):
  reader = tf.train.load_checkpoint(prefix)
  return {
    k: reader.get_tensor(k)
    for k, dtype in reader.get_variable_to_dtype_map().items()
    if 'network' in k and dtype.is_floating
  }


@pytest.mark.slow
def testResumeAfterSigkillReadsTheSameRecords(tmp_path):
  files = ','.join(_Good(tmp_path / f'train-{k}', seed=k) for k in range(2))
  killed = tmp_path / 'killed'
  train_dir = killed / 'train'
  args = ('--model_params_override=task.train.save_interval_steps : 10',)
  log = open(tmp_path / 'log.txt', 'w')
  proc = subprocess.Popen(
    _Cmd(killed, files, '--max_steps=100000', *args),
    cwd=REPO,
    env=_Env(),
    stdout=log,
    stderr=subprocess.STDOUT,
  )
  try:
    deadline = time.time() + TIMEOUT
    while not checkpointer.LatestCheckpoint(str(train_dir)):
      assert proc.poll() is None and time.time() < deadline
      time.sleep(0.05)
    time.sleep(0.3)
  finally:
    proc.kill()
    proc.wait(timeout=30)
    log.close()
  step = checkpointer.StepOf(checkpointer.LatestCheckpoint(str(train_dir)))
  end = step + 10
  # The killed run resumes; a fresh run goes straight to the same step.
  res = _Train(killed, files, f'--max_steps={end}', *args)
  assert res.returncode == 0, res.stderr[-3000:]
  assert 'cannot be checkpointed' not in res.stderr
  res = _Train(tmp_path / 'straight', files, f'--max_steps={end}', *args)
  assert res.returncode == 0, res.stderr[-3000:]
  got = _Weights(str(train_dir / f'ckpt-{end}'))
  want = _Weights(str(tmp_path / 'straight' / 'train' / f'ckpt-{end}'))
  assert got and got.keys() == want.keys()
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)


def testNativeWarningsThatRepeatTheErrorAreDropped():
  # An op that fails in TensorFlow's C++ code logs two warnings (OP_REQUIRES
  # failed, Local rendezvous is aborting) before Python sees the error.
  program = textwrap.dedent(
    """
    import sys
    from absl import logging
    import tensorflow as tf
    from lingvo_gpipe import trainer_errors
    if sys.argv[1] == 'filter':
      trainer_errors.FilterNativeLog()
    logging.use_absl_handler()
    logging.warning('before')
    try:
      tf.io.read_file('/nonexistent/file')
    except tf.errors.OpError as e:
      trainer_errors.Exit(1, trainer_errors.OneLine(e))
    """
  )
  env = dict(_Env(), TF_CPP_MIN_LOG_LEVEL='1')
  for mode in ('filter', 'no_filter'):
    res = subprocess.run(
      [sys.executable, '-c', program, mode],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=60,
    )
    assert res.returncode == 1, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    assert lines[-1] == (
      'ERROR: NotFoundError from TensorFlow: /nonexistent/file; No such '
      'file or directory'
    ), res.stderr[-3000:]
    assert any(ln.endswith('] before') for ln in lines), res.stderr[-3000:]
    noisy = 'OP_REQUIRES failed' in res.stderr
    assert noisy == (mode == 'no_filter'), res.stderr[-3000:]


def _MountTmpfs(path, size):
  path.mkdir()
  res = subprocess.run(
    ['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(path)],
    capture_output=True,
    check=False,
  )
  if res.returncode:
    pytest.skip('needs a small tmpfs (mount, as root) to fill a disk')


def testFullDiskIsOneCleanLineAndKeepsTheLastCheckpoint(tmp_path):
  disk = tmp_path / 'disk'
  _MountTmpfs(disk, '2m')  # params.txt and two checkpoints of 0.9 MB.
  try:
    env = trainer_process.Env(native_warnings=True)
    res = subprocess.run(
      trainer_process.Cmd(
        f'--logdir={disk / "logdir"}',
        '--max_steps=20',
        '--model_params_override=task.train.save_interval_steps : 1',
      ),
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=TIMEOUT,
    )
    assert res.returncode == 1, res.stderr[-3000:]
    line = _ErrorLine(res)
    train_dir = disk / 'logdir' / 'train'
    latest = checkpointer.LatestCheckpoint(str(train_dir))
    step = checkpointer.StepOf(latest)
    assert line.startswith(
      f'ERROR: Could not write checkpoint {train_dir}/ckpt-{step + 1} at '
      f'step {step + 1}: No space left on device (writing {train_dir}/'
      f'ckpt-{step + 1}_temp/part-00000-of-00001.data-00000-of-00001) ('
    ), line
    assert 'MiB free on the disk of' in line, line
    assert line.endswith(f'the previous checkpoint {latest} is intact.')
    assert 'OP_REQUIRES' not in res.stderr and '{{' not in res.stderr
    assert res.stderr.splitlines()[-1] == line
    reader = tf.train.load_checkpoint(latest)  # Restorable.
    assert reader.get_tensor(checkpointer.VariableKey('global_step')) == step
  finally:
    subprocess.run(['umount', '-l', str(disk)], check=False)


def testSigintDuringStartupExits130(tmp_path):
  proc = subprocess.Popen(
    _Cmd(tmp_path / 'logdir', 'none'),
    cwd=REPO,
    env=_Env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  time.sleep(1.0)  # TensorFlow is still loading.
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 130, err[-3000:]
  lines = [ln for ln in err.splitlines() if ln.startswith('ERROR:')]
  assert lines == [
    'ERROR: SIGINT during start-up: exiting before anything was trained or '
    'saved.'
  ], err[-3000:]
  assert 'Traceback' not in err


def testSecondSignalEndsAProcessBlockedInTensorFlow(tmp_path):
  # The main thread blocks in a TensorFlow op that never returns (as in a
  # step waiting on a stopped worker); Python handlers cannot run there.
  program = textwrap.dedent(
    """
    import sys
    import tensorflow as tf
    from lingvo_gpipe.runners import train_loop
    stop = train_loop.StopRequest()
    stop.InstallSignalHandlers()
    queue = tf.queue.FIFOQueue(1, tf.float32)
    print('blocking', flush=True)
    queue.dequeue()
    """
  )
  proc = subprocess.Popen(
    [sys.executable, '-c', program],
    cwd=REPO,
    env=_Env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    assert proc.stdout.readline().strip() == 'blocking'
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None  # The first signal only asks to stop.
    start = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=10)
    assert time.time() - start < 5
  finally:
    proc.kill()
    proc.wait(timeout=30)
  err = proc.stderr.read()
  assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
  assert err.count('Second SIGTERM') == 1, err[-3000:]  # Not also logged.
  assert 'ERROR: Second SIGTERM: exiting now without saving' in err


@pytest.mark.slow
def testDivergedWeightsAreNeverTheLastGoodModel(tmp_path):
  files = _Good(tmp_path / 'train-0')
  logdir = tmp_path / 'logdir'
  res = _Train(
    logdir,
    files,
    '--max_steps=60',
    '--model_params_override=task.train.learning_rate : 1e30',
    '--model_params_override=task.train.save_interval_steps : 1',
  )
  assert res.returncode == 1, res.stderr[-3000:]
  line = _ErrorLine(res)
  assert 'The last good model is the last checkpoint' in line, line
  latest = checkpointer.LatestCheckpoint(str(logdir / 'train'))
  if latest is not None:
    reader = tf.train.load_checkpoint(latest)
    for key, dtype in reader.get_variable_to_dtype_map().items():
      if 'network' in key and dtype.is_floating and 'Adam' not in key:
        assert np.all(np.abs(reader.get_tensor(key)) <= 1e6), key
  # The logdir recovers at a sane learning rate, without deleting files.
  res = _Train(logdir, files, '--max_steps=80', '--allow_params_change')
  assert res.returncode == 0, res.stderr[-3000:]


def testOneLineOfEachKindOfError(tmp_path):
  from lingvo_gpipe import trainer  # pylint: disable=g-import-not-at-top

  message = (
    '{{function_node __wrapped__IteratorGetNext_output_types_2_device_/job:'
    'localhost/replica:0/task:0/device:CPU:0}} assertion failed: [CifarInput:'
    ' label out of [0, 10) for cifar10 (fine); set p.dataset. Label and '
    'file:] [17] [/data/x.bin]\n\t [[{{node Assert/Assert}}]] '
    '[Op:IteratorGetNext] name: '
  )
  error = tf.errors.InvalidArgumentError(None, None, message)
  assert trainer.OneLine(error) == (
    '[CifarInput: label out of [0, 10) for cifar10 (fine); set p.dataset. '
    'Label and file:] [17] [/data/x.bin]'
  )
  error = tf.errors.DataLossError(
    None, None, '{{function_node x}} corrupted record at 0 [Op:Foo] name: '
  )
  assert trainer.OneLine(error) == (
    'DataLossError from TensorFlow: corrupted record at 0'
  )
  try:
    {}['key']
  except KeyError as e:
    line = trainer.OneLine(e, str(tmp_path))
  path = tmp_path / 'error_traceback.txt'
  assert line == f"KeyError: 'key' (traceback in {path})"
  assert 'Traceback' in path.read_text()
  assert '\n' not in trainer.OneLine(
    trainer.UserError('first line\nsecond line')
  )
