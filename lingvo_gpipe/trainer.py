r"""The trainer binary: `python -m lingvo_gpipe.trainer` / `gpipe_trainer`.

Lingvo's flags, one process:

  gpipe_trainer --model=image.digits.MlpDigitsTiny --logdir=/tmp/digits \
      --run_locally=cpu --num_cpu_devices=2 --worker_split_size=2 \
      --job=trainer,evaler_dev --max_steps=200

Under a tf.distribute strategy (as in Lingvo): --tpu=NAME runs the train loop
under TPUStrategy with --worker_split_size=K cores (pipeline stages) per
replica; --strategy=mirrored under MirroredStrategy over this host's GPUs or
virtual CPU devices, one device per replica. Each replica runs the step on
its share of the batch (strategy.run, distribute_datasets_from_function);
checkpoints and summaries are as without a strategy.

Devices: --worker_split_size=K stages per pipeline, --worker_replicas=R
data-parallel copies of it, on R*K devices of this host (--num_cpu_devices /
--num_gpu_devices split the CPU / a GPU into virtual devices) or of remote
TensorFlow workers (--cluster_spec=worker=host:port,host:port, or TF_CONFIG;
start the workers with gpipe_tf_server or tools/local_cluster.py). The
placement (which layer on which device) is logged at start and written to
<logdir>/placement.txt. If a worker dies, the trainer exits with status 1
naming it; rerun it (after restarting the worker) to resume from the last
checkpoint.

Modes: `sync` (default; runs the --job list: trainer / trainer_client,
evaler_<dataset>, decoder_<dataset>), `inspect_params` (prints the Params
text), `inspect_model` (prints variables, parameter count and pipeline
placement), `export` (writes a SavedModel of the latest checkpoint's
predictions to --export_dir). Jobs given together run in one process: the
trainer in the main thread, evalers in threads.

Layout of --logdir:

  params.txt                 the model Params (after every override); a
                             resume with other Params is refused unless
                             --allow_params_change
  trainer.lock               the trainer that owns the logdir (host, pid)
  train/                     checkpoints (ckpt-<step>.*, checkpoint) and
                             training summaries; broken/ holds checkpoints
                             set aside because they did not restore
  eval_dev/, eval_test/      evaler summaries and metrics.jsonl
  decoder_dev/               decoder outputs (decoder_out_<step>.npz)

Exit status: 0 after training (also after SIGINT/SIGTERM, which save a
checkpoint first; a second signal ends the process at once, with status
128 + signal number), 1 with a one-line reason on any error of any job
(unknown model, bad override, bad input data, incompatible checkpoint,
NaN loss, unwritable logdir, a lost worker; an unexpected error's traceback
goes to <logdir>/error_traceback.txt), 130 on SIGINT during start-up.
docs/reliability.md lists what survives which fault.
"""

# The job loop is this module; the flags are in trainer_flags.py, what they
# build (devices, strategy, model Params) in trainer_params.py, how errors
# end the process in trainer_errors.py, and what the trainer does about its
# remote workers (their memory, a stuck step, freeing them at exit) in
# trainer_workers.py.

import os
import signal
import sys
import threading

from lingvo_gpipe.core import quiet_start


def _StartupSignal(signum, unused_frame):
  """SIGINT/SIGTERM while TensorFlow loads: one line, exit 128 + signum."""
  name = signal.Signals(signum).name
  sys.stderr.flush()
  # Straight to the real stderr: TensorFlow's import may be filtering fd 2.
  os.write(
    quiet_start.StderrFd(),
    f'ERROR: {name} during start-up: exiting before anything was trained '
    'or saved.\n'.encode(),
  )
  os._exit(128 + signum)  # pylint: disable=protected-access


# Run as a program, the handlers go in before the slow imports below, so an
# early Ctrl-C gives one line and status 130, not a traceback.
if __name__ == '__main__':
  for _signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_signum, _StartupSignal)


from absl import app
from absl import flags
from absl import logging

# TensorFlow's C++ INFO lines (the start-up banner) are noise in the
# trainer's log; warnings and errors stay. TF_CPP_MIN_LOG_LEVEL=0 shows them.
quiet_start.ImportTensorFlow(min_log_level='1')

# pylint: disable=g-import-not-at-top
import tensorflow as tf

from lingvo_gpipe import trainer_errors
from lingvo_gpipe import trainer_flags
from lingvo_gpipe import trainer_logdir
from lingvo_gpipe import trainer_params
from lingvo_gpipe import trainer_workers
from lingvo_gpipe.core import distribute
from lingvo_gpipe.runners import checkpointer
from lingvo_gpipe.runners import evaler
from lingvo_gpipe.runners import exporter
from lingvo_gpipe.runners import train_loop
from lingvo_gpipe.runners import trainer_state

# The trainer's public names, kept importable from here.
from lingvo_gpipe.trainer_errors import OneLine
from lingvo_gpipe.trainer_errors import SetUpLogging
from lingvo_gpipe.trainer_errors import UserError
from lingvo_gpipe.trainer_params import ApplyWorkerSplit
from lingvo_gpipe.trainer_params import BuildParams
from lingvo_gpipe.trainer_params import ConfigureDevices
from lingvo_gpipe.trainer_params import CreateStrategy
from lingvo_gpipe.trainer_params import InspectModel
from lingvo_gpipe.trainer_params import LogdirOverrides
from lingvo_gpipe.trainer_params import ParseJobs
from lingvo_gpipe.trainer_params import PipelineLayers
from lingvo_gpipe.trainer_params import PlacementText
# pylint: enable=g-import-not-at-top

__all__ = [
  'main',
  'BuildParams',
  'ApplyWorkerSplit',
  'ConfigureDevices',
  'CreateStrategy',
  'PipelineLayers',
  'ParseJobs',
  'PlacementText',
  'InspectModel',
  'UserError',
  'OneLine',
  'LogdirOverrides',
  'SetUpLogging',
]

FLAGS = flags.FLAGS
# `--help` lists the trainer's flags as this binary's own.
flags.adopt_module_key_flags(trainer_flags)

# The cluster of this process, set by main() before anything is built.
_CLUSTER = None
# The tf.distribute strategy of the trainer (--strategy, --tpu), or None.
_STRATEGY = None


def _FlagParams(dataset='Train', under_strategy=False, from_logdir=False):
  """`trainer_params.FlagParams` on this process's cluster and strategy."""
  return trainer_params.FlagParams(
    _CLUSTER, _STRATEGY, dataset, under_strategy, from_logdir
  )


# -- Jobs ----------------------------------------------------------------------


# Jobs of one process build their models one at a time: model construction
# (variable creation and naming, optimizer slots) is not meant to run in two
# threads at once, and it is fast next to training.
_BUILD_LOCK = threading.Lock()


def _RunTrainer(p, logdir, stop):
  """The trainer job: resume (or fine-tune), train, save; a TrainResult."""
  train_dir = os.path.join(logdir, 'train')
  checkpointer.CheckWritableDir(logdir)
  try:
    rules = checkpointer.ParseRestoreMap(FLAGS.restore_map)
  except ValueError as e:
    raise UserError(str(e)) from e
  trainer_workers.WarnIfKilledBefore(train_dir, _CLUSTER)
  strategy = _STRATEGY
  with _BUILD_LOCK, (strategy or tf.distribute.get_strategy()).scope():
    try:
      model = p.Instantiate()
    except trainer_errors.BUILD_ERRORS as e:
      raise trainer_errors.BuildError('building the model', e) from e
  text = PlacementText(model)
  if strategy is not None:  # Its replicas and devices replace the cluster's.
    text = distribute.Describe(strategy) + '\n' + text
  elif _CLUSTER is not None:
    stages = max(
      (pipe.num_stages for pipe in trainer_params.Pipelines(model)), default=1
    )
    text = _CLUSTER.Describe(num_stages=stages) + '\n' + text
  logging.info('Placement:\n%s', text)
  task = model.GetTask()
  tp = p.task.train
  batch_size = iterator = None
  if strategy is None:
    iterator = iter(task.input_generator.GetDataset())
    trainer_params.CheckBatchSizes(model, iterator)
  else:
    batch_size = task.input_generator.GlobalBatchSize()
    try:
      distribute.CheckBatchSize(strategy, batch_size)
    except ValueError as e:
      raise UserError(
        f'{"--tpu" if FLAGS.tpu is not None else "--strategy"}: {e}'
      ) from e
  ckpt = checkpointer.Checkpointer(
    train_dir,
    model.VariablesByName(),
    iterator=iterator,
    max_to_keep=tp.save_max_to_keep,
    save_interval_steps=tp.save_interval_steps,
    save_interval_seconds=trainer_params.SaveIntervalSeconds(tp),
  )
  resumed = trainer_errors.Restore(ckpt, train_dir, _CLUSTER)
  if resumed is None and FLAGS.restore_from:
    report = checkpointer.FineTuneRestore(
      model.VariablesByName(),
      FLAGS.restore_from,
      rules,
      skip=(model.global_step.name.split(':')[0],),
    )
    logging.info('Fine-tuning restore:\n%s', report)
    if not report.restored:
      raise UserError(
        f'--restore_from={FLAGS.restore_from} restored no '
        f'variable:\n{report}\nFix --restore_map.'
      )
  if strategy is not None:
    # A distributed iterator cannot be checkpointed: the input resumes at
    # the batch after the global step's (the input is deterministic).
    dataset = distribute.DistributeDataset(
      strategy,
      task.input_generator.GetDataset,
      batch_size,
      skip_batches=int(model.global_step.numpy()),
    )
    with strategy.scope():
      iterator = iter(dataset)
  trainer_logdir.CheckParamsChange(
    logdir, p, resumed, FLAGS.allow_params_change
  )
  # Written once the logdir is known to be this model's (not clobbering the
  # params.txt of another model whose checkpoint was refused).
  with tf.io.gfile.GFile(os.path.join(logdir, 'params.txt'), 'w') as f:
    f.write(p.ToText())
  with tf.io.gfile.GFile(os.path.join(logdir, 'placement.txt'), 'w') as f:
    f.write(text + '\n')
  trainer_state.WriteTrainerState(train_dir, running=True)
  memory = trainer_workers.WatchMemory(_CLUSTER, model)
  watchdog = trainer_workers.Watchdog(
    train_dir,
    _CLUSTER,
    memory,
    FLAGS.step_timeout_s,
    FLAGS.min_step_timeout_s,
  )
  loop = train_loop.TrainLoop(
    task,
    model.global_step,
    iterator,
    ckpt,
    tp.max_steps,
    summary_dir=train_dir,
    log_interval_steps=FLAGS.log_interval_steps,
    summary_interval_steps=tp.summary_interval_steps,
    stop=stop,
    watchdog=watchdog,
    max_weight_abs=FLAGS.max_weight_abs,
    batch_size=batch_size,
    strategy=strategy,
    worker_memory=memory,
  )
  try:
    return loop.Run()
  except tf.errors.OpError as e:
    trainer_errors.RaiseIfWorkerLost(e, train_dir, _CLUSTER, memory=memory)
    raise
  except trainer_errors.BUILD_ERRORS as e:
    raise trainer_errors.BuildError(
      'building or running the training step', e
    ) from e
  except checkpointer.CheckpointError as e:
    # A save that failed because a worker died names the worker, not the
    # disk.
    if isinstance(e.__cause__, tf.errors.OpError):
      trainer_errors.RaiseIfWorkerLost(
        e.__cause__, train_dir, _CLUSTER, memory=memory
      )
    raise
  finally:
    if watchdog is not None:
      watchdog.Stop()
    try:
      step = int(model.global_step.numpy())
    except tf.errors.OpError:  # On a worker that is gone: the error above
      step = None  # says so; do not replace it with this one.
    trainer_state.WriteTrainerState(train_dir, running=False, step=step)


def _RunEvaler(
  kind, dataset, logdir, stop, errors, trainer_stop=None, standalone=False
):
  """Runs an evaler/decoder job; exceptions go to `errors` and stop the
  trainer (`trainer_stop`), which saves and exits.

  A standalone one (no trainer in this process) builds the model with the
  overrides of the logdir's params.txt and ends once the trainer has exited
  and its last checkpoint is evaluated.
  """
  try:
    cls = evaler.Decoder if kind == 'decoder' else evaler.Evaler
    with _BUILD_LOCK:
      ev = cls(
        _FlagParams(dataset, from_logdir=standalone),
        logdir,
        dataset=dataset,
        interval_seconds=FLAGS.eval_interval_seconds,
        timeout_seconds=FLAGS.eval_timeout,
        max_batches=FLAGS.eval_max_batches,
        until_trainer_exits=standalone,
        idle_timeout_seconds=FLAGS.eval_idle_timeout_s,
      )
    logging.info(
      '%s_%s pipeline placement:\n%s',
      kind,
      dataset.lower(),
      PlacementText(ev.model),
    )
    ev.Run(stop=stop)
  except Exception as e:  # pylint: disable=broad-except
    job = f'{kind}_{dataset.lower()}'
    if isinstance(e, trainer_errors.BUILD_ERRORS):
      e = trainer_errors.BuildError(f'building or running {job}', e)
    errors.append((job, e))
    if trainer_stop is not None:  # The error is the process's last line.
      logging.warning('%s failed: stopping the trainer, which saves.', job)
      trainer_stop.Set(f'{job} failed')


def _Sync():
  """Runs the --job list: the trainer here, evalers/decoders in threads."""
  if not FLAGS.logdir:
    raise UserError('--logdir is required with --mode=sync.')
  jobs = ParseJobs(FLAGS.job)
  stop = train_loop.StopRequest()
  stop.InstallSignalHandlers()
  # Validates flags before any thread starts.
  train_p = _FlagParams('Train', under_strategy=_STRATEGY is not None)
  has_trainer = any(kind == 'trainer' for kind, _ in jobs)
  # Evalers next to a trainer stop after it: they evaluate the last
  # checkpoint it wrote, then return.
  eval_stop = train_loop.StopRequest() if has_trainer else stop
  lock = None
  if has_trainer:  # Before the evalers start: a refusal ends the process.
    checkpointer.CheckWritableDir(FLAGS.logdir)
    lock = trainer_logdir.OwnLogdir(FLAGS.logdir)
  errors, threads = [], []
  for kind, dataset in jobs:
    if kind != 'trainer':
      t = threading.Thread(
        target=_RunEvaler,
        name=f'{kind}_{dataset.lower()}',
        args=(
          kind,
          dataset,
          FLAGS.logdir,
          eval_stop,
          errors,
          stop if has_trainer else None,
          not has_trainer,
        ),
        daemon=True,
      )
      threads.append(t)
      t.start()
  try:
    if has_trainer:
      _RunTrainer(train_p, FLAGS.logdir, stop)
  finally:
    if has_trainer:
      if lock is not None:
        lock.Release()
      eval_stop.Set('trainer finished')
    for t in threads:
      while t.is_alive():  # Short joins: signals reach the main thread.
        t.join(timeout=0.5)
  if errors:
    job, error = errors[0]
    raise UserError(f'{job}: {OneLine(error, FLAGS.logdir)}') from error


def _Export():
  if not FLAGS.logdir:
    raise UserError('--mode=export needs --logdir (its latest checkpoint).')
  p = _FlagParams('Test')
  model = p.Instantiate()
  train_dir = os.path.join(FLAGS.logdir, 'train')
  prefix = checkpointer.LatestCheckpoint(train_dir)
  if prefix is None:
    raise UserError(
      f'--mode=export: no checkpoint in {train_dir}; train first.'
    )
  checkpointer.Checkpointer(
    train_dir, model.VariablesByName(), writable=False
  ).RestoreFrom(prefix, strict=False)
  out = FLAGS.export_dir or os.path.join(FLAGS.logdir, 'inference')
  exporter.ExportSavedModel(
    model.GetTask(), out, variables=model.VariablesByName()
  )
  print(f'Exported {prefix} to {out}')


def _Main(unused_argv):
  global _CLUSTER, _STRATEGY
  _CLUSTER = trainer_params.FlagCluster()
  _STRATEGY = trainer_params.FlagStrategy()
  if FLAGS.mode == 'inspect_params':
    print(_FlagParams('Train').ToText(), end='')
  elif FLAGS.mode == 'inspect_model':
    print(InspectModel(_FlagParams('Train').Instantiate()))
  elif FLAGS.mode == 'export':
    _Export()
  else:
    _Sync()


def _Run(argv):
  SetUpLogging()
  trainer_errors.FilterNativeLog()
  try:
    _Main(argv)
  except KeyboardInterrupt:
    trainer_errors.Exit(
      130, 'SIGINT during start-up: exiting before anything was saved.'
    )
  except SystemExit:
    raise
  except BaseException as e:  # pylint: disable=broad-except
    trainer_errors.Exit(1, OneLine(e, FLAGS.logdir))
  trainer_errors.Exit(0)


def main(argv=None):
  """Console-script entry point (`gpipe_trainer`)."""
  app.run(_Run, argv=argv)


if __name__ == '__main__':
  main()
