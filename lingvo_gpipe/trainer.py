r"""The trainer binary: `python -m lingvo_gpipe.trainer` / `gpipe_trainer`.

Over 500 lines: the binary's flags, their checks and the job loop, as Lingvo's
trainer.py keeps them.

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

  params.txt                 the model Params (after every override)
  train/                     checkpoints (ckpt-<step>.*, checkpoint) and
                             training summaries
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

import logging as std_logging
import os
import re
import signal
import sys
import threading
import time

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

import traceback

from absl import app
from absl import flags
from absl import logging

# TensorFlow's C++ INFO lines (the start-up banner) are noise in the
# trainer's log; warnings and errors stay. TF_CPP_MIN_LOG_LEVEL=0 shows them.
quiet_start.ImportTensorFlow(min_log_level='1')

# pylint: disable=g-import-not-at-top
import tensorflow as tf

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import cluster
from lingvo_gpipe.core import distribute
from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.input import imagenet
from lingvo_gpipe.pipeline import pipelining_layer
from lingvo_gpipe.pipeline import placement
from lingvo_gpipe.runners import checkpointer
from lingvo_gpipe.runners import evaler
from lingvo_gpipe.runners import exporter
from lingvo_gpipe.runners import train_loop
# pylint: enable=g-import-not-at-top

__all__ = [
  'main',
  'BuildParams',
  'ApplyWorkerSplit',
  'ConfigureDevices',
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

flags.DEFINE_string(
  'model', None, 'Registered model key, e.g. image.digits.MlpDigitsTiny.'
)
flags.DEFINE_string(
  'logdir',
  None,
  'Directory of params.txt, checkpoints, summaries and eval results.',
)
flags.DEFINE_enum(
  'mode',
  'sync',
  ['sync', 'async', 'inspect_params', 'inspect_model', 'export'],
  'sync/async: run the --job list (one process either way); '
  'inspect_params: print the Params; inspect_model: print '
  'variables, parameter count and pipeline placement; export: '
  'SavedModel of the latest checkpoint to --export_dir.',
)
flags.DEFINE_enum(
  'run_locally', None, ['cpu', 'gpu'], 'cpu: hide GPUs; gpu: require one.'
)
flags.DEFINE_string(
  'job',
  'trainer',
  'Comma list of trainer | trainer_client | '
  'evaler_<dataset> | decoder_<dataset>, e.g. '
  '"trainer,evaler_dev".',
)
flags.DEFINE_multi_string(
  'model_params_override',
  [],
  'Lingvo text-format lines "a.b.c : value" applied '
  'to the model Params (repeat the flag, or separate '
  'lines with newlines or ";").',
)
flags.DEFINE_string(
  'model_params_file_override',
  None,
  'A file of "a.b.c : value" lines applied to the model '
  'Params (before --model_params_override).',
)
flags.DEFINE_integer(
  'worker_split_size',
  None,
  'Devices per model split: sets num_stages (and the '
  'first N devices) of every PipeliningLayer.',
  lower_bound=1,
)
flags.DEFINE_integer(
  'worker_replicas',
  1,
  'Data-parallel replicas R of every PipeliningLayer: the '
  'pipelines use R * worker_split_size devices; each '
  'replica runs 1/R of the batch and the gradients are '
  'summed.',
  lower_bound=1,
)
flags.DEFINE_enum(
  'strategy',
  None,
  ['mirrored'],
  'Run the train loop under a tf.distribute strategy: mirrored = '
  "MirroredStrategy over this host's GPUs (else its virtual CPU devices), "
  'one device per replica, --worker_replicas of them (default: all); each '
  "replica runs the whole step, its pipelines' cells on its device.",
)
flags.DEFINE_string(
  'tpu',
  None,
  'Run the train loop under TPUStrategy on this TPU: "" or "local" (this '
  'TPU VM, or the one TPU_NAME names), a Cloud TPU name, or '
  '"grpc://<ip>:8470"; --worker_split_size=K cores (pipeline stages) per '
  'replica, --worker_replicas of them (default: all that fit).',
)
flags.DEFINE_integer(
  'num_cpu_devices',
  None,
  'Split the host CPU into N virtual devices (before any TensorFlow op).',
  lower_bound=1,
)
flags.DEFINE_integer(
  'num_gpu_devices',
  None,
  'Split the first GPU into N logical GPUs (tests of '
  'multi-GPU pipelines on one GPU); needs '
  '--gpu_memory_limit_mb.',
  lower_bound=1,
)
flags.DEFINE_integer(
  'gpu_memory_limit_mb',
  None,
  'Memory of each logical GPU (--num_gpu_devices).',
  lower_bound=1,
)
flags.DEFINE_string(
  'cluster_spec',
  None,
  'Remote TensorFlow workers that run the model: '
  '"worker=host:port,host:port" (Lingvo\'s form) or JSON '
  '{"worker": [...]}. Default: TF_CONFIG if set, else this '
  "host's devices.",
)
flags.DEFINE_string(
  'worker_job',
  'worker',
  'The job of --cluster_spec whose devices run the model.',
)
flags.DEFINE_float(
  'connect_timeout_s', 30.0, 'Bound on reaching each remote worker at start.'
)
flags.DEFINE_float(
  'step_timeout_s',
  None,
  'Exit with status 1, naming the dead or silent workers, if one training '
  'step (with its checkpoint) takes longer (the first step: 4 times '
  'longer). Default with --cluster_spec/TF_CONFIG: max('
  '--min_step_timeout_s (60 s), 10 x the running median step time), 900 s '
  'for the first step; off on one host. '
  '0: off.',
)
flags.DEFINE_float(
  'min_step_timeout_s',
  60.0,
  'The floor of the default step timeout: max(this, 10 x the running '
  'median step time). Ignored with --step_timeout_s.',
  lower_bound=1.0,
)
flags.DEFINE_float(
  'max_weight_abs',
  1e6,
  'A checkpoint save refuses trainable weights larger than this in '
  'absolute value (diverged training); 0: only NaN/Inf are refused.',
)
flags.DEFINE_integer(
  'max_steps', None, 'Overrides task.train.max_steps.', lower_bound=0
)
flags.DEFINE_integer('seed', None, 'Model random_seed (overrides Params).')
flags.DEFINE_float(
  'eval_interval_seconds',
  10.0,
  'Evaler: seconds between polls for a new checkpoint.',
)
flags.DEFINE_float(
  'eval_timeout',
  0.0,
  'Evaler: exit after this many seconds without a new '
  'checkpoint; 0: wait for the final step (a standalone evaler also '
  'exits once the trainer has exited and its last checkpoint is '
  'evaluated).',
)
flags.DEFINE_alias('eval_timeout_s', 'eval_timeout')
flags.DEFINE_integer(
  'eval_max_batches', None, 'Evaler: at most this many batches per evaluation.'
)
flags.DEFINE_string(
  'restore_from',
  None,
  'Fine-tuning: on a fresh start (no checkpoint in the '
  'logdir), initialize from this checkpoint (prefix or '
  'directory).',
)
flags.DEFINE_alias('checkpoint_to_restore', 'restore_from')
flags.DEFINE_multi_string(
  'restore_map',
  [],
  'With --restore_from: REGEX=>NAME; a model variable '
  'matching REGEX is read from checkpoint variable '
  'NAME (\\1 or %s for groups). Default: same names.',
)
flags.DEFINE_integer(
  'saver_max_to_keep',
  None,
  'Checkpoints kept; overrides task.train.save_max_to_keep.',
)
flags.DEFINE_float(
  'save_interval_seconds',
  None,
  'Also save a checkpoint after this many seconds (default: '
  'task.train.save_interval_seconds unless '
  'save_interval_steps is set).',
)
flags.DEFINE_integer(
  'log_interval_steps',
  10,
  'A progress line every this many steps.',
  lower_bound=1,
)
flags.DEFINE_string(
  'export_dir',
  None,
  '--mode=export: output directory (default <logdir>/inference).',
)


class UserError(Exception):
  """A mistake in the flags or the model; reported in one line, exit 1."""


# The exceptions that building a model or tracing its step raise for a
# mistake in the model (a bad Params value, cells that do not fit together).
_BUILD_ERRORS = (ValueError, TypeError, NotImplementedError)


def _BuildError(what, error):
  """A UserError for `error`, a mistake in the model raised while `what`;
  the traceback is logged at verbosity 1 (--v=1)."""
  logging.vlog(1, 'Traceback of the error while %s:', what, exc_info=error)
  return UserError(f'{OneLine(error, is_user_error=True)} (while {what})')


def _CheckBatchSizes(model, iterator):
  """Checks, before the first step, that each pipeline's replicas and
  micro-batches divide the training batch (when its size is static)."""
  leaves = [
    s
    for s in tf.nest.flatten(iterator.element_spec)
    if isinstance(s, tf.TensorSpec) and s.shape.rank
  ]
  if not leaves or leaves[0].shape[0] is None:
    return
  batch = int(leaves[0].shape[0])
  for pipe in _Pipelines(model):
    if pipe.params.batch_dim != 0:
      continue
    try:
      pipe.CheckBatch(batch)
    except ValueError as e:
      raise UserError(str(e)) from e


# -- Devices -------------------------------------------------------------------


def ConfigureDevices(num_cpu_devices=None, run_locally=None, **kwargs):
  """Makes the job's devices (see cluster.Cluster.Params for `kwargs`):
  splits the CPU / a GPU, hides GPUs, connects to remote workers. Must run
  before any TensorFlow op. Returns the cluster.Cluster."""
  try:
    c = cluster.Cluster(
      cluster.Cluster.Params().Set(
        num_cpu_devices=num_cpu_devices, run_locally=run_locally, **kwargs
      )
    )
    return c.Configure()
  except (RuntimeError, ValueError, TimeoutError) as e:
    raise UserError(str(e)) from e


def _FlagCluster():
  return ConfigureDevices(
    FLAGS.num_cpu_devices,
    FLAGS.run_locally,
    num_gpu_devices=FLAGS.num_gpu_devices,
    gpu_memory_limit_mb=FLAGS.gpu_memory_limit_mb,
    cluster_spec=FLAGS.cluster_spec,
    worker_job=FLAGS.worker_job,
    worker_split_size=FLAGS.worker_split_size,
    worker_replicas=FLAGS.worker_replicas,
    connect_timeout_s=FLAGS.connect_timeout_s,
  )


# The cluster of this process, set by main() before anything is built.
_CLUSTER = None
# The tf.distribute strategy of the trainer (--strategy, --tpu), or None.
_STRATEGY = None


def CreateStrategy(
  strategy=None, tpu=None, worker_split_size=None, worker_replicas=None
):
  """The trainer's tf.distribute strategy (see `distribute.CreateStrategy`),
  or None; flag mistakes and a missing TPU raise UserError."""
  try:
    return distribute.CreateStrategy(
      strategy, tpu, worker_split_size or 1, worker_replicas
    )
  except (RuntimeError, ValueError) as e:
    raise UserError(str(e)) from e


def _FlagStrategy():
  if FLAGS.strategy and FLAGS.tpu is not None:
    return CreateStrategy(FLAGS.strategy, FLAGS.tpu)  # Raises.
  if FLAGS.strategy is None and FLAGS.tpu is None:
    return None
  replicas = FLAGS.worker_replicas if FLAGS['worker_replicas'].present else None
  if FLAGS.cluster_spec:
    raise UserError(
      '--cluster_spec with --strategy/--tpu: the strategy runs on this '
      "host's devices (or the TPU); drop --cluster_spec."
    )
  return CreateStrategy(
    FLAGS.strategy, FLAGS.tpu, FLAGS.worker_split_size, replicas
  )


# -- Params --------------------------------------------------------------------


def _OverrideText(lines):
  out = []
  for chunk in lines or []:
    out.extend(part for part in chunk.replace(';', '\n').split('\n'))
  return '\n'.join(out)


# Int params of a pipeline that also take 'auto' (resolved by the planner).
_AUTO_PARAMS = ('num_stages', 'num_micro_batches')


def _ApplyText(p, text, where):
  """Applies 'a.b.c : value' lines; `...num_stages : 'auto'` (or
  num_micro_batches) sets 'auto', which the int parser would refuse."""
  rest = []
  for line in text.split('\n'):
    key, sep, value = line.partition(':')
    key = key.strip()
    if (
      sep
      and key.split('.')[-1] in _AUTO_PARAMS
      and value.strip().strip('\'"') == 'auto'
    ):
      try:
        p.Set(**{key: 'auto'})
      except (AttributeError, ValueError, KeyError) as e:
        raise UserError(f'{where}: {e}') from e
      continue
    rest.append(line)
  try:
    p.FromText('\n'.join(rest))
  except (AttributeError, ValueError) as e:
    raise UserError(f'{where}: {e}') from e


def PipelineLayers(p):
  """[(key, Params)] of the PipeliningLayer Params inside model Params `p`."""
  found = []

  def Enter(key, value):
    if (
      isinstance(value, hyperparams.InstantiableParams)
      and isinstance(value.cls, type)
      and issubclass(value.cls, pipelining_layer.PipeliningLayer)
    ):
      found.append((key, value))
    return True

  p.Visit(lambda k, v: None, enter_fn=Enter)
  return found


def ApplyWorkerSplit(p, num_stages, devices=None, num_replicas=1):
  """Sets the stages, replicas and devices of every PipeliningLayer in `p`.

  Args:
    p: model Params.
    num_stages: K (--worker_split_size); None keeps each pipeline's own.
    devices: the devices to use (default: this host's accelerators or CPUs);
      replica r's stages get devices[r*K:(r+1)*K].
    num_replicas: R (--worker_replicas).

  Returns:
    The keys of the pipelines changed ([] if the model has none).
  """
  devices = list(devices) if devices else placement.DefaultDevices()
  keys = []
  for key, lp in PipelineLayers(p):
    k = (
      num_stages
      or len(lp.cell_tpl)
      or lp.num_stages
      or (len(lp.devices) // max(1, lp.num_replicas) if lp.devices else 1)
    )
    if k == 'auto':
      # The pipeline's planner chooses K for these devices at build time.
      lp.num_replicas = num_replicas
      lp.devices = list(devices)
      keys.append(key)
      continue
    if k * num_replicas > len(devices):
      what = (
        f'--worker_replicas={num_replicas} x --worker_split_size={k} '
        f'need {k * num_replicas} devices'
        if num_replicas > 1
        else f'--worker_split_size={k} needs {k} devices'
      )
      raise UserError(
        f'{what} but only {len(devices)} exist ({devices}). Use '
        f'--num_cpu_devices={k * num_replicas} on CPU, more workers in '
        '--cluster_spec, or fewer stages/replicas.'
      )
    if lp.cell_tpl:
      if len(lp.cell_tpl) != k:
        raise UserError(
          f'--worker_split_size={k}: the pipeline at {key or "."} '
          f'has {len(lp.cell_tpl)} fixed cells (cell_tpl); give it a flat '
          '`layers` list to let the library re-split it.'
        )
    else:
      lp.num_stages = k
      if isinstance(lp.splits, int) or (
        lp.splits is not None and len(lp.splits) != k
      ):
        lp.splits = None
    lp.num_replicas = num_replicas
    lp.devices = devices[: k * num_replicas]
    keys.append(key)
  if not keys:
    logging.warning(
      '--worker_split_size / --worker_replicas: the model has '
      'no PipeliningLayer; nothing to split.'
    )
  return keys


def _GetParams(model, dataset):
  try:
    return model_registry.GetParams(model, dataset)
  except LookupError as e:  # Unknown model (KeyError) or dataset.
    raise UserError(str(e.args[0]) if e.args else str(e)) from e


def BuildParams(
  model,
  dataset='Train',
  file_override=None,
  overrides=(),
  worker_split_size=None,
  max_steps=None,
  seed=None,
  max_to_keep=None,
  worker_replicas=1,
  devices=None,
  under_strategy=False,
  logdir_params=None,
):
  """The model Params for `dataset` with every override applied.

  With `under_strategy` (the model is built under a tf.distribute strategy,
  whose replicas are the data parallelism), `worker_split_size` sets the
  cells of every pipeline and their devices are left to the strategy.
  `logdir_params`, the text of a logdir's params.txt, is applied first: the
  fields where it differs from the registered Train Params (the overrides
  the model was trained with), except inputs and placement.
  """
  if not model:
    raise UserError(
      '--model is required, e.g. --model=image.digits.MlpDigitsTiny.'
    )
  p = _GetParams(model, dataset)
  if logdir_params:
    text = LogdirOverrides(_GetParams(model, 'Train'), logdir_params)
    if text:
      _ApplyText(p, text, "the logdir's params.txt")
  if file_override:
    try:
      with open(file_override) as f:
        text = f.read()
    except OSError as e:
      raise UserError(
        f'--model_params_file_override={file_override!r}: {e.strerror}.'
      ) from e
    _ApplyText(p, text, f'--model_params_file_override={file_override}')
  text = _OverrideText(overrides)
  if text.strip():
    _ApplyText(p, text, '--model_params_override')
  if max_steps is not None:
    p.task.train.max_steps = max_steps
  if max_to_keep is not None:
    p.task.train.save_max_to_keep = max_to_keep
  if seed is not None:
    p.random_seed = seed
    if 'random_seed' in p.task:
      p.task.random_seed = seed
  if under_strategy:
    _ApplyStrategySplit(p, worker_split_size)
  elif worker_split_size or (worker_replicas or 1) > 1 or devices:
    ApplyWorkerSplit(p, worker_split_size, devices, worker_replicas or 1)
  _FillAutoBatch(p)
  return p


def _FillAutoBatch(p):
  """Gives pipelines with num_stages / num_micro_batches = 'auto' the
  training batch size where their input_shapes leave the batch unknown,
  so that the planner can resolve them."""
  inp = p.Get('input') if 'input' in p else None
  batch = getattr(inp, 'batch_size', None)
  if not batch:
    return
  for _, lp in PipelineLayers(p):
    if 'auto' not in (lp.num_stages, lp.num_micro_batches):
      continue
    if not lp.input_shapes:
      continue
    shapes = []
    for s in lp.input_shapes:
      if isinstance(s, (list, tuple)) and s and s[lp.batch_dim] is None:
        s = list(s)
        s[lp.batch_dim] = batch
      shapes.append(s)
    lp.input_shapes = shapes


def _ApplyStrategySplit(p, num_stages):
  """K cells per pipeline, one replica each, no devices (the strategy's)."""
  for _, lp in PipelineLayers(p):
    if num_stages and lp.cell_tpl and len(lp.cell_tpl) != num_stages:
      raise UserError(
        f'--worker_split_size={num_stages}: a pipeline has '
        f'{len(lp.cell_tpl)} fixed cells (cell_tpl); give it a flat '
        '`layers` list to let the library re-split it.'
      )
    if num_stages and not lp.cell_tpl:
      lp.num_stages = num_stages
      if isinstance(lp.splits, int) or (
        lp.splits is not None and len(lp.splits) != num_stages
      ):
        lp.splits = None
    lp.num_replicas = 1
    lp.devices = None


# Params fields that a logdir's params.txt does not carry over to an evaler:
# its input (the training data) and the placement (the evaler's own flags).
_NOT_FROM_LOGDIR = ('input', 'devices', 'num_stages', 'splits', 'num_replicas')


def LogdirOverrides(train_params, params_text):
  """The "a.b : value" lines of `params_text` (a params.txt) that differ
  from `train_params`, the model's registered Train Params: the overrides it
  was trained with, less inputs and placement (`_NOT_FROM_LOGDIR`)."""

  def Lines(text):
    out = {}
    for line in text.splitlines():
      key, sep, _ = line.partition(' : ')
      if sep:
        out[key.strip()] = line
    return out

  registered = Lines(train_params.ToText())
  lines = []
  for key, line in Lines(params_text).items():
    parts = key.split('.')
    if any(
      part.split('[')[0] in _NOT_FROM_LOGDIR for part in parts
    ) or key.endswith('.cls'):
      continue
    if registered.get(key) != line:
      lines.append(line)
  return '\n'.join(lines)


def _LogdirParams():
  """The text of <logdir>/params.txt, or None."""
  path = os.path.join(FLAGS.logdir or '', 'params.txt')
  if not FLAGS.logdir or not tf.io.gfile.exists(path):
    return None
  with tf.io.gfile.GFile(path) as f:
    return f.read()


def _FlagParams(dataset='Train', under_strategy=False, from_logdir=False):
  devices = None
  if _CLUSTER is not None and _CLUSTER.is_remote:
    devices = _CLUSTER.Devices()
  return BuildParams(
    FLAGS.model,
    dataset,
    FLAGS.model_params_file_override,
    FLAGS.model_params_override,
    FLAGS.worker_split_size,
    FLAGS.max_steps,
    FLAGS.seed,
    FLAGS.saver_max_to_keep,
    # Evalers run without the strategy: one pipeline replica.
    FLAGS.worker_replicas if _STRATEGY is None else 1,
    devices,
    under_strategy,
    logdir_params=_LogdirParams() if from_logdir else None,
  )


# -- Inspection ----------------------------------------------------------------


def _Pipelines(model):
  return [
    m
    for m in model.submodules
    if isinstance(m, pipelining_layer.PipeliningLayer)
  ]


def PlacementText(model):
  """Which layers of `model`'s pipelines run on which device."""
  pipes = _Pipelines(model)
  if not pipes:
    return 'No PipeliningLayer: the model runs on the default device.'
  return '\n'.join(pipe.PlacementText() for pipe in pipes)


def InspectModel(model):
  """Variables, parameter count and placement of a built model, as text."""
  variables = model.VariablesByName()
  width = max((len(n) for n in variables), default=0)
  lines = ['Variables:']
  total = trainable = 0
  for name in sorted(variables):
    v = variables[name]
    n = int(v.shape.num_elements())
    total += n
    trainable += n if v.trainable else 0
    lines.append(
      f'  {name:<{width}}  {str(v.shape.as_list()):<14} '
      f'{v.dtype.base_dtype.name:<8} {v.device}'
    )
  lines.append(
    f'{len(variables)} variables, {total:,} parameters '
    f'({trainable:,} trainable).'
  )
  lines.append(PlacementText(model))
  return '\n'.join(lines)


# -- Jobs ----------------------------------------------------------------------


def _SaveIntervalSeconds(tp):
  """Lingvo's rule: save_interval_steps, if set, replaces the time rule."""
  if FLAGS.save_interval_seconds is not None:
    return FLAGS.save_interval_seconds
  return None if tp.save_interval_steps else tp.save_interval_seconds


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
  strategy = _STRATEGY
  with _BUILD_LOCK, (strategy or tf.distribute.get_strategy()).scope():
    try:
      model = p.Instantiate()
    except _BUILD_ERRORS as e:
      raise _BuildError('building the model', e) from e
  text = PlacementText(model)
  if strategy is not None:  # Its replicas and devices replace the cluster's.
    text = distribute.Describe(strategy) + '\n' + text
  elif _CLUSTER is not None:
    stages = max((pipe.num_stages for pipe in _Pipelines(model)), default=1)
    text = _CLUSTER.Describe(num_stages=stages) + '\n' + text
  logging.info('Placement:\n%s', text)
  task = model.GetTask()
  tp = p.task.train
  batch_size = iterator = None
  if strategy is None:
    iterator = iter(task.input_generator.GetDataset())
    _CheckBatchSizes(model, iterator)
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
    save_interval_seconds=_SaveIntervalSeconds(tp),
  )
  if ckpt.Restore() is None and FLAGS.restore_from:
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
  # Written once the logdir is known to be this model's (not clobbering the
  # params.txt of another model whose checkpoint was refused).
  with tf.io.gfile.GFile(os.path.join(logdir, 'params.txt'), 'w') as f:
    f.write(p.ToText())
  with tf.io.gfile.GFile(os.path.join(logdir, 'placement.txt'), 'w') as f:
    f.write(text + '\n')
  evaler.WriteTrainerState(train_dir, running=True)
  watchdog = _Watchdog(train_dir)
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
  )
  try:
    return loop.Run()
  except tf.errors.OpError as e:
    _RaiseIfWorkerLost(e, train_dir)
    raise
  except _BUILD_ERRORS as e:
    raise _BuildError('building or running the training step', e) from e
  except checkpointer.CheckpointError as e:
    # A save that failed because a worker died names the worker, not the
    # disk.
    if isinstance(e.__cause__, tf.errors.OpError):
      _RaiseIfWorkerLost(e.__cause__, train_dir)
    raise
  finally:
    if watchdog is not None:
      watchdog.Stop()
    try:
      step = int(model.global_step.numpy())
    except tf.errors.OpError:  # On a worker that is gone: the error above
      step = None  # says so; do not replace it with this one.
    evaler.WriteTrainerState(train_dir, running=False, step=step)


def _StepTimeout():
  """Seconds, 0 (off) or None (auto: from the running median step time)."""
  if FLAGS.step_timeout_s is not None:
    return FLAGS.step_timeout_s
  return None if _CLUSTER is not None and _CLUSTER.is_remote else 0.0


def _Watchdog(train_dir):
  """A StepWatchdog that ends the process naming the workers (or None)."""
  timeout = _StepTimeout()
  if timeout == 0:
    return None
  floor = FLAGS.min_step_timeout_s
  rule = (
    f'--step_timeout_s={timeout:g}'
    if timeout is not None
    else f'the default step timeout, max({floor:g} s '
    '(--min_step_timeout_s), 10 x the median step time)'
  )

  def OnTimeout(step, elapsed, bound):
    lost = _CLUSTER.UnreachableWorkers() if _CLUSTER is not None else []
    silent = []
    if not lost and _CLUSTER is not None and _CLUSTER.is_remote:
      silent = _CLUSTER.SilentWorkers()
    if lost:
      who = (
        f'worker {", ".join(lost)} no longer accepts connections (the '
        'process died or its host is down)'
      )
    elif silent:
      who = (
        f'worker {", ".join(silent)} accepts connections but does not '
        'answer (stopped, swapping or deadlocked)'
      )
    elif _CLUSTER is not None and _CLUSTER.is_remote:
      who = (
        'every worker answers, so the step is slower than the bound or '
        'stuck inside a worker; set --step_timeout_s if it is just slow'
      )
    else:
      who = 'raise --step_timeout_s if the step is just slow'
    last = checkpointer.LatestCheckpoint(train_dir)
    _Exit(
      1,
      f'Step {step} did not finish within {elapsed:.0f} s (bound '
      f'{bound:.0f} s, {rule}): {who}. The last checkpoint is '
      f'{last or "none"}; fix the workers and rerun the trainer to resume '
      'from it.',
    )

  logging.info(
    'Step timeout: %s.',
    rule if timeout is not None else rule + ', 900 s for the first step',
  )
  return train_loop.StepWatchdog(timeout, OnTimeout, min_timeout_s=floor)


# What TensorFlow raises when a remote worker goes away during a step.
_LOST_WORKER_ERRORS = (
  tf.errors.UnavailableError,
  tf.errors.AbortedError,
  tf.errors.CancelledError,
  tf.errors.InternalError,
  tf.errors.UnknownError,
)


_LOST_WORKER_GRACE_S = 5.0


def _RaiseIfWorkerLost(error, train_dir):
  """Turns the error of a step that lost a remote worker into a UserError
  naming the worker (the trainer then exits with status 1)."""
  if (
    _CLUSTER is None
    or not _CLUSTER.is_remote
    or not isinstance(error, _LOST_WORKER_ERRORS)
  ):
    return
  lost = _CLUSTER.UnreachableWorkers()
  # A worker killed mid-step can fail the step a moment before its port
  # closes (the process is still being torn down): look again for a while.
  deadline = time.time() + _LOST_WORKER_GRACE_S
  while not lost and time.time() < deadline:
    time.sleep(0.25)
    lost = _CLUSTER.UnreachableWorkers()
  if not lost:
    return
  last = checkpointer.LatestCheckpoint(train_dir)
  first_line = str(error).strip().splitlines()[0] if str(error) else ''
  raise UserError(
    f'Lost worker {", ".join(lost)} during training: it no longer accepts '
    f'connections (the process died or its host is down). The last '
    f'checkpoint is {last or "none"}; restart the worker and rerun the '
    f'trainer to resume from it. (TensorFlow: {type(error).__name__}: '
    f'{first_line})'
  ) from error


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
      )
    logging.info(
      '%s_%s pipeline placement:\n%s',
      kind,
      dataset.lower(),
      PlacementText(ev.model),
    )
    ev.Run(stop=stop)
  except _BUILD_ERRORS as e:
    errors.append(
      _BuildError(f'building or running {kind}_{dataset.lower()}', e)
    )
  except UserError as e:
    errors.append(e)
  except Exception as e:  # pylint: disable=broad-except
    job = f'{kind}_{dataset.lower()}'
    logging.error('%s failed: %s', job, OneLine(e, logdir))
    errors.append((job, e))
    if trainer_stop is not None:
      trainer_stop.Set(f'{job} failed')


def ParseJobs(text):
  """'trainer,evaler_dev' -> [('trainer', None), ('evaler', 'Dev')]."""
  jobs = [j.strip() for j in (text or '').split(',') if j.strip()]
  out = []
  for job in jobs:
    if job in ('trainer', 'trainer_client'):
      out.append(('trainer', None))
    elif job.startswith(('evaler_', 'decoder_')) and job.count('_') == 1:
      kind, dataset = job.split('_')
      out.append((kind, dataset.capitalize()))
    else:
      raise UserError(
        f'--job: unknown job {job!r}; use trainer, '
        'trainer_client, evaler_<dataset> (e.g. evaler_dev) or '
        'decoder_<dataset>, comma-separated.'
      )
  if not out:
    raise UserError('--job is empty; use e.g. --job=trainer.')
  return out


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
  _CLUSTER = _FlagCluster()
  _STRATEGY = _FlagStrategy()
  if FLAGS.mode == 'inspect_params':
    print(_FlagParams('Train').ToText(), end='')
  elif FLAGS.mode == 'inspect_model':
    print(InspectModel(_FlagParams('Train').Instantiate()))
  elif FLAGS.mode == 'export':
    _Export()
  else:
    _Sync()


_KNOWN_ERRORS = (
  UserError,
  checkpointer.CheckpointError,
  train_loop.NonFiniteError,
)


def _TensorFlowText(error):
  """The first meaningful line of a TensorFlow error, without the
  {{function_node ...}} and [Op:...] decorations."""
  text = str(getattr(error, 'message', None) or error)
  text = re.sub(r'\{\{function_node [^}]*\}\}\s*', '', text)
  lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
  line = lines[0] if lines else ''
  line = re.sub(r'^Error in user-defined function .*?: (?=assertion)', '', line)
  line = re.sub(r'\s*\[\[\{\{node .*', '', line)
  return re.sub(r'\s*\[Op:[^\]]*\].*$', '', line).strip()


def OneLine(error, logdir=None, is_user_error=False):
  """The one-line message the trainer exits with for `error`.

  Args:
    error: the exception.
    logdir: where an unexpected error's traceback goes
      (error_traceback.txt), if it exists.
    is_user_error: `error` is a mistake in the flags or the model, as the
      `_KNOWN_ERRORS` are: its whole message, no traceback.

  An error raised while tf.function traced a step carries the frames of the
  user's code ("in user code: File ..."); the message is what follows its
  last "<ErrorType>: ".
  """
  text = str(error).strip()
  if 'in user code:' in text:
    marker = f'{type(error).__name__}: '
    if marker in text:
      text = text[text.rindex(marker) + len(marker) :].strip()
  if is_user_error or isinstance(error, _KNOWN_ERRORS):
    return ' '.join(text.split('\n')).strip() or type(error).__name__
  if isinstance(error, tf.errors.OpError):
    message = imagenet.ErrorMessage(error)
    if message:
      return message
    text = _TensorFlowText(error)
    if text.startswith('assertion failed: '):  # An input's own check.
      text = text[len('assertion failed: ') :]
      return text.replace("\\'", "'").replace('\\"', '"')
    return f'{type(error).__name__} from TensorFlow: {text}'
  where = 'the log (--verbosity=1)'
  if logdir and tf.io.gfile.isdir(logdir):
    path = os.path.join(logdir, 'error_traceback.txt')
    try:
      with open(path, 'w') as f:
        f.write(''.join(traceback.format_exception(error)))
      where = path
    except OSError:
      pass
  logging.vlog(1, '%s', ''.join(traceback.format_exception(error)))
  first = text.split('\n')[0]
  return f'{type(error).__name__}: {first} (traceback in {where})'


def _Exit(status, message=None):
  """Reports `message` in one line and ends the process without running
  interpreter shutdown (which can block in TensorFlow's destructors)."""
  if message:  # Printed once, not also as a log line.
    sys.stderr.write(f'ERROR: {message}\n')
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(status)  # pylint: disable=protected-access


# TensorFlow's Python INFO lines that are noise in the trainer's log: its
# checkpoint saver's timing at every save, and the ~20-line session config
# that connecting to remote workers (--cluster_spec) dumps.
_NOISE = ('Sharding callback duration', 'default session config:')


class _DropNoise(std_logging.Filter):
  """Drops the log records whose message starts with one of `_NOISE`."""

  def filter(self, record):
    return not record.getMessage().startswith(_NOISE)


_DROP_NOISE = _DropNoise()


def SetUpLogging():
  """The trainer's log filters, in one place: drops TensorFlow's `_NOISE`
  lines (its Python logger's records reach absl's handler)."""
  for logger in (tf.get_logger(), logging.get_absl_logger()):
    if _DROP_NOISE not in logger.filters:
      logger.addFilter(_DROP_NOISE)


def _Run(argv):
  SetUpLogging()
  try:
    _Main(argv)
  except KeyboardInterrupt:
    _Exit(130, 'SIGINT during start-up: exiting before anything was saved.')
  except SystemExit:
    raise
  except BaseException as e:  # pylint: disable=broad-except
    _Exit(1, OneLine(e, FLAGS.logdir))
  _Exit(0)


def main(argv=None):
  """Console-script entry point (`gpipe_trainer`)."""
  app.run(_Run, argv=argv)


if __name__ == '__main__':
  main()
