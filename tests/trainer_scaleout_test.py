"""The trainer across devices: data-parallel replicas, remote workers, and a
worker that dies during training.
"""

import os
import signal
import time

import numpy as np
import tensorflow as tf

from lingvo_gpipe import trainer
from lingvo_gpipe.core import cluster
from lingvo_gpipe.runners import checkpointer
from lingvo_gpipe.runners import device_memory
from tests.testing import trainer_process

MODEL = 'image.digits.MlpDigitsTinyBN'


def _TrainInProcess(p, batches):
  model = p.Instantiate()
  step = tf.function(model.GetTask().TrainStep, autograph=False)
  for batch in batches:
    step(batch)
  return {name: v.numpy() for name, v in model.VariablesByName().items()}


def testReplicasGiveTheUpdateOfOneReplicaWithTheWholeBatch():
  """R=2 replicas x K=2 stages (M=2 each, 4 devices) == R=1 x K=2 with M=4:
  weights, batch-norm moving averages and Adam slots after 3 steps."""
  dp = trainer.BuildParams(
    MODEL,
    'Train',
    worker_split_size=2,
    worker_replicas=2,
    overrides=['task.network.num_micro_batches : 2'],
  )
  one = trainer.BuildParams(
    MODEL,
    'Train',
    worker_split_size=2,
    overrides=['task.network.num_micro_batches : 4'],
  )
  assert dp.task.network.num_replicas == 2
  assert len(dp.task.network.devices) == 4
  inputs = one.task.input.Instantiate()
  it = iter(inputs.GetDataset())
  batches = [next(it) for _ in range(3)]
  got = _TrainInProcess(dp, batches)
  want = _TrainInProcess(one, batches)
  assert sorted(got) == sorted(want)
  assert any('moving_mean' in n for n in got)
  for name in want:
    np.testing.assert_allclose(
      got[name], want[name], rtol=2e-5, atol=2e-6, err_msg=name
    )
  # Training moved the weights: the comparison is not of initial values.
  init = {n: v.numpy() for n, v in one.Instantiate().VariablesByName().items()}
  assert any(
    not np.allclose(init[n], want[n]) for n in want if n.endswith('/w')
  )


def testTooManyReplicasNamesBothNumbers():
  try:
    trainer.BuildParams(MODEL, 'Train', worker_split_size=2, worker_replicas=3)
  except trainer.UserError as e:
    assert (
      '--worker_replicas=3 x --worker_split_size=2 need 6 devices but '
      'only 4 exist'
    ) in str(e)
  else:
    raise AssertionError('no error')


def testTrainerWithReplicasWritesPlacement(tmp_path):
  logdir = tmp_path / 'logdir'
  res = trainer_process.Run(
    f'--logdir={logdir}',
    '--worker_replicas=2',
    '--worker_split_size=1',
    '--max_steps=5',
    model=MODEL,
  )
  assert res.returncode == 0, res.stderr[-3000:]
  text = (logdir / 'placement.txt').read_text()
  assert '2 data-parallel replicas' in text
  assert 'CPU:1 (replica 1)' in text
  assert '1 replica(s)' not in text and '2 replica(s) x 1 stage(s)' in text


# Bytes a worker may still hold after a trainer of MODEL has ended.
_LEFT_PER_RUN = 48 * 1024


def _HeldBytes(local, task):
  """What worker `task`'s allocator holds now (its status endpoint)."""
  status = device_memory.StatusMap(local.devices, local.status_addresses)
  device = local.devices[task]
  return device_memory.DeviceMemory([device], status)[device][0]


def testRemoteWorkersAndAWorkerDyingMidTraining(tmp_path):
  """K=2 stages on 2 worker processes; killing one makes the trainer exit 1
  naming it and the checkpoint to resume from, which the pointer still
  names; after a restart the trainer resumes from it.

  Each time the trainer ends, its variables are freed on the workers that
  remain (it ends by os._exit, which deletes no handle).

  A checkpoint is saved at every step, so the kill lands during a save (or
  the step right after one): the save cut off by the lost worker must leave
  the previous checkpoint in place.
  """
  logdir = tmp_path / 'logdir'
  train_dir = logdir / 'train'

  def Files():
    return sorted(os.listdir(train_dir)) if train_dir.is_dir() else []

  with cluster.LocalCluster(
    2, startup_timeout_s=60, memory_stats=True
  ) as local:
    spec = 'worker=' + ','.join(local.addresses)
    idle = _HeldBytes(local, 0)
    args = [
      f'--logdir={logdir}',
      f'--cluster_spec={spec}',
      '--worker_split_size=2',
      '--log_interval_steps=1',
      '--model_params_override=task.train.save_interval_steps : 1',
    ]
    proc = trainer_process.Proc(
      str(tmp_path / 'log1.txt'),
      *args,
      '--max_steps=100000',
      native_warnings=True,
    )
    try:
      proc.WaitFor(lambda: trainer_process.Latest(train_dir) >= 5, timeout=180)
      before = trainer_process.Latest(train_dir)
      log = proc.Log()
      assert '/job:worker/replica:0/task:1/device:CPU:0' in log
      local.Kill(1)
      t0 = time.time()
      proc.proc.wait(timeout=120)
      assert time.time() - t0 < 60
    finally:
      proc.Close()
    log = proc.Log()
    errors = [ln for ln in log.splitlines() if ln.startswith('ERROR:')]
    assert proc.proc.returncode == 1, log[-3000:]
    assert len(errors) == 1, log[-3000:]
    assert (
      f'ERROR: Lost worker /job:worker/task:1 ({local.addresses[1]})'
    ) in errors[0], log[-3000:]
    # The trainer read each worker's memory after the first step, and names
    # the lost worker's last reading (not an out-of-memory kill: SIGKILL).
    assert 'Worker memory (resident, peak): /job:worker/task:0 ' in log, log
    assert 'Its last measured resident memory was ' in errors[0], errors[0]
    assert 'ran out of memory' not in errors[0], errors[0]
    # TensorFlow's native warnings that repeat the loss are dropped.
    for noise in ('rendezvous', 'GRPC', 'Failed to register', 'OP_REQUIRES'):
      assert noise not in log, log[-3000:]
    # The checkpoint the trainer names is the one the pointer names, and no
    # older than the one seen before the kill.
    last = checkpointer.LatestCheckpoint(str(train_dir))
    assert last, (errors[0], Files())
    saved = checkpointer.StepOf(last)
    assert saved >= before >= 5, (saved, before, errors[0], Files())
    assert f'The last checkpoint is {last}; restart the worker' in errors[0], (
      errors[0],
      Files(),
    )
    assert not [f for f in Files() if f.endswith('_temp')], Files()
    # The worker that remains holds no variable of the trainer that exited.
    assert 'Freed ' in log and ' variables of this trainer on the workers' in (
      log
    ), log[-3000:]
    # Worker 0 held the trainer's weights and Adam slots of its cell (about
    # 110 KB; all of it stayed there before the trainer emptied them). What
    # remains (about 31 KB) is the dead client's function state, which
    # TensorFlow keeps until the worker restarts.
    assert _HeldBytes(local, 0) - idle < _LEFT_PER_RUN, _HeldBytes(local, 0)
    # Restart the worker; the trainer resumes from the checkpoint.
    local.Restart(1)
    res = trainer_process.Run(*args, f'--max_steps={saved + 3}')
    assert res.returncode == 0, res.stderr[-3000:]
    assert f'Restored {last}.' in res.stderr, res.stderr[-3000:]
    assert trainer_process.Latest(train_dir) == saved + 3
    for task in (0, 1):
      held = _HeldBytes(local, task) - idle
      assert held < (2 - task) * _LEFT_PER_RUN, (task, held)
  assert not os.path.exists(logdir / 'train' / 'checkpoint.tmp')


def testStuckWorkerEndsTheTrainerWithinTheStepTimeout(tmp_path):
  """A worker that stops answering (SIGSTOP: its sockets still accept) would
  block the step forever; --step_timeout_s ends the trainer with status 1."""
  logdir = tmp_path / 'logdir'
  train_dir = logdir / 'train'
  with cluster.LocalCluster(2, startup_timeout_s=60) as local:
    proc = trainer_process.Proc(
      str(tmp_path / 'log.txt'),
      f'--logdir={logdir}',
      '--cluster_spec=worker=' + ','.join(local.addresses),
      '--worker_split_size=2',
      '--step_timeout_s=3',
      '--max_steps=100000',
      '--model_params_override=task.train.save_interval_steps : 5',
    )
    try:
      proc.WaitFor(lambda: trainer_process.Latest(train_dir) >= 5, timeout=180)
      os.kill(local.pids[1], signal.SIGSTOP)
      t0 = time.time()
      proc.proc.wait(timeout=120)
      elapsed = time.time() - t0
    finally:
      os.kill(local.pids[1], signal.SIGCONT)
      proc.Close()
  log = proc.Log()
  assert proc.proc.returncode == 1, log[-3000:]
  assert elapsed < 30, elapsed
  assert 'did not finish within' in log and '--step_timeout_s=3' in log, log[
    -3000:
  ]
  assert (
    f'worker /job:worker/task:1 ({local.addresses[1]}) accepts connections '
    'but does not answer'
  ) in log, log[-3000:]
  # Connecting to the workers logged no session-config dump.
  assert 'default session config' not in log, log[-3000:]


def testDefaultStepTimeoutEndsTheTrainerWhenAWorkerStops(tmp_path):
  """Without --step_timeout_s the bound is max(--min_step_timeout_s, 10 x the
  median step): a stopped worker ends the trainer with status 1 soon after
  the floor, one line naming the worker, and the slow step in the log."""
  logdir = tmp_path / 'logdir'
  train_dir = logdir / 'train'
  with cluster.LocalCluster(2, startup_timeout_s=60) as local:
    proc = trainer_process.Proc(
      str(tmp_path / 'log.txt'),
      f'--logdir={logdir}',
      '--cluster_spec=worker=' + ','.join(local.addresses),
      '--worker_split_size=2',
      '--min_step_timeout_s=4',
      '--max_steps=100000',
      '--model_params_override=task.train.save_interval_steps : 5',
    )
    stopped = False
    try:
      proc.WaitFor(lambda: trainer_process.Latest(train_dir) >= 5, timeout=180)
      os.kill(local.pids[1], signal.SIGSTOP)
      stopped = True
      t0 = time.time()
      proc.proc.wait(timeout=120)
      elapsed = time.time() - t0
    finally:
      if stopped:
        os.kill(local.pids[1], signal.SIGCONT)
      proc.Close()
  log = proc.Log()
  assert proc.proc.returncode == 1, log[-3000:]
  # The 4 s bound, the 3 s handshake probe, and the process's exit.
  assert 4 < elapsed < 30, elapsed
  assert 'Step timeout: the default step timeout, max(4 s' in log, log[-3000:]
  assert 'has been running for' in log, log[-3000:]  # Logged while stuck.
  errors = [ln for ln in log.splitlines() if ln.startswith('ERROR:')]
  assert len(errors) == 1, log[-3000:]
  assert 'Traceback' not in log, log[-3000:]
  assert 'did not finish within' in errors[0]
  assert '(--min_step_timeout_s), 10 x the median step time)' in errors[0]
  assert (
    f'worker /job:worker/task:1 ({local.addresses[1]}) accepts connections '
    'but does not answer'
  ) in errors[0], errors[0]
  last = checkpointer.LatestCheckpoint(str(train_dir))
  assert last and trainer_process.Latest(train_dir) >= 5
  assert f'The last checkpoint is {last};' in errors[0], errors[0]


def testSecondSigtermEndsATrainerBlockedOnAStoppedWorker(tmp_path):
  """A step blocked on a stopped worker (the step timeout far away) cannot
  save: the first SIGTERM is logged at once, the second ends the process
  within seconds with one line and status 128 + SIGTERM."""
  logdir = tmp_path / 'logdir'
  train_dir = logdir / 'train'
  with cluster.LocalCluster(2, startup_timeout_s=60) as local:
    proc = trainer_process.Proc(
      str(tmp_path / 'log.txt'),
      f'--logdir={logdir}',
      '--cluster_spec=worker=' + ','.join(local.addresses),
      '--worker_split_size=2',
      '--step_timeout_s=600',
      '--max_steps=100000',
      '--model_params_override=task.train.save_interval_steps : 5',
    )
    stopped = False
    try:
      proc.WaitFor(lambda: trainer_process.Latest(train_dir) >= 5, timeout=180)
      os.kill(local.pids[1], signal.SIGSTOP)
      stopped = True
      time.sleep(1.0)  # The next step now waits on the stopped worker.
      assert proc.proc.poll() is None
      proc.proc.send_signal(signal.SIGTERM)
      proc.WaitFor(lambda: 'SIGTERM received: saving' in proc.Log(), timeout=10)
      time.sleep(0.5)
      assert proc.proc.poll() is None  # Blocked: the save cannot happen.
      t0 = time.time()
      proc.proc.send_signal(signal.SIGTERM)
      proc.proc.wait(timeout=30)
      elapsed = time.time() - t0
    finally:
      if stopped:
        os.kill(local.pids[1], signal.SIGCONT)
      proc.Close()
  log = proc.Log()
  assert proc.proc.returncode == 128 + signal.SIGTERM, log[-3000:]
  assert elapsed < 5, elapsed
  errors = [ln for ln in log.splitlines() if ln.startswith('ERROR:')]
  assert errors == [
    'ERROR: Second SIGTERM: exiting now without saving; the last checkpoint '
    'stays the one to resume from.'
  ], log[-3000:]
  assert log.count('Second SIGTERM') == 1, log[-3000:]  # Not also logged.
  assert 'Traceback' not in log, log[-3000:]
  assert trainer_process.Latest(train_dir) >= 5  # Still there, restorable.


def testBadDeviceFlagsFailInOneLine(tmp_path):
  port = cluster.FreePorts(1)[0]
  cases = [
    (
      ['--num_gpu_devices=2', '--gpu_memory_limit_mb=512'],
      'TensorFlow finds no GPU',
    ),
    (['--cluster_spec=worker'], "'worker' is not \"job=host:port"),
    (
      [f'--cluster_spec=worker=127.0.0.1:{port}', '--connect_timeout_s=2'],
      f'worker:0: Worker at 127.0.0.1:{port} is not reachable',
    ),
    (
      ['--worker_replicas=3', '--worker_split_size=1'],
      '--worker_replicas=3 x --worker_split_size=1 need 3 devices but only '
      '2 exist',
    ),
  ]
  for args, message in cases:
    t0 = time.time()
    res = trainer_process.Run(f'--logdir={tmp_path / "logdir"}', *args)
    assert res.returncode == 1, (args, res.stderr[-2000:])
    assert message in res.stderr, (args, res.stderr[-2000:])
    assert 'Traceback' not in res.stderr, res.stderr[-2000:]
    assert time.time() - t0 < 60
