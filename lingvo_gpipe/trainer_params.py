"""What the trainer builds from its flags: devices, strategy, model Params.

`ConfigureDevices` and `CreateStrategy` make the job's devices and its
tf.distribute strategy; `BuildParams` gives the registered model's Params
with every override applied (a params.txt, --model_params_file_override,
--model_params_override, --worker_split_size / --worker_replicas, which
`ApplyWorkerSplit` applies to every PipeliningLayer, and the 'auto' fields
the planner resolves). The `Flag*` functions call them with the values of
the flags (trainer_flags.py); `ParseJobs` reads --job. `PlacementText` and
`InspectModel` describe a built model.
"""

import os

from absl import logging
import tensorflow as tf

from lingvo_gpipe import model_registry
from lingvo_gpipe import trainer_errors
from lingvo_gpipe import trainer_flags
from lingvo_gpipe.core import cluster
from lingvo_gpipe.core import distribute
from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.pipeline import pipelining_layer
from lingvo_gpipe.pipeline import placement

FLAGS = trainer_flags.FLAGS


# -- Devices and strategy ------------------------------------------------------


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
    raise trainer_errors.UserError(str(e)) from e


def FlagCluster():
  """`ConfigureDevices` of the device flags."""
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
    raise trainer_errors.UserError(str(e)) from e


def FlagStrategy():
  """`CreateStrategy` of --strategy / --tpu, or None."""
  if FLAGS.strategy and FLAGS.tpu is not None:
    return CreateStrategy(FLAGS.strategy, FLAGS.tpu)  # Raises.
  if FLAGS.strategy is None and FLAGS.tpu is None:
    return None
  replicas = FLAGS.worker_replicas if FLAGS['worker_replicas'].present else None
  if FLAGS.cluster_spec:
    raise trainer_errors.UserError(
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
        raise trainer_errors.UserError(f'{where}: {e}') from e
      continue
    rest.append(line)
  try:
    p.FromText('\n'.join(rest))
  except (AttributeError, ValueError) as e:
    raise trainer_errors.UserError(f'{where}: {e}') from e


def PipelineLayers(p, outermost=False):
  """[(key, Params)] of the PipeliningLayer Params inside model Params `p`
  (with `outermost`, not those inside another pipeline's Params)."""
  found = []

  def Enter(key, value):
    if (
      isinstance(value, hyperparams.InstantiableParams)
      and isinstance(value.cls, type)
      and issubclass(value.cls, pipelining_layer.PipeliningLayer)
    ):
      found.append((key, value))
      return not outermost
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
      raise trainer_errors.UserError(
        f'{what} but only {len(devices)} exist ({devices}). Use '
        f'--num_cpu_devices={k * num_replicas} on CPU, more workers in '
        '--cluster_spec, or fewer stages/replicas.'
      )
    if lp.cell_tpl:
      if len(lp.cell_tpl) != k:
        raise trainer_errors.UserError(
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
    raise trainer_errors.UserError(str(e.args[0]) if e.args else str(e)) from e


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
    raise trainer_errors.UserError(
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
      raise trainer_errors.UserError(
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
      raise trainer_errors.UserError(
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


def FlagParams(
  job_cluster,
  strategy,
  dataset='Train',
  under_strategy=False,
  from_logdir=False,
):
  """`BuildParams` of the flags for `dataset`, on the devices of
  `job_cluster` (the process's cluster.Cluster, or None) when its workers are
  remote; `strategy` is the trainer's tf.distribute strategy, or None."""
  devices = None
  if job_cluster is not None and job_cluster.is_remote:
    devices = job_cluster.Devices()
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
    FLAGS.worker_replicas if strategy is None else 1,
    devices,
    under_strategy,
    logdir_params=_LogdirParams() if from_logdir else None,
  )


def SaveIntervalSeconds(tp):
  """Seconds between checkpoints for train Params `tp`:
  --save_interval_seconds, else Lingvo's rule: save_interval_steps, if set,
  replaces the time rule."""
  if FLAGS.save_interval_seconds is not None:
    return FLAGS.save_interval_seconds
  return None if tp.save_interval_steps else tp.save_interval_seconds


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
      raise trainer_errors.UserError(
        f'--job: unknown job {job!r}; use trainer, '
        'trainer_client, evaler_<dataset> (e.g. evaler_dev) or '
        'decoder_<dataset>, comma-separated.'
      )
  if not out:
    raise trainer_errors.UserError('--job is empty; use e.g. --job=trainer.')
  return out


# -- Inspection ----------------------------------------------------------------


def Pipelines(model):
  """The PipeliningLayers of a built model."""
  return [
    m
    for m in model.submodules
    if isinstance(m, pipelining_layer.PipeliningLayer)
  ]


def CheckBatchSizes(model, iterator):
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
  for pipe in Pipelines(model):
    if pipe.params.batch_dim != 0:
      continue
    try:
      pipe.CheckBatch(batch)
    except ValueError as e:
      raise trainer_errors.UserError(str(e)) from e


def PlacementText(model):
  """Which layers of `model`'s pipelines run on which device."""
  pipes = Pipelines(model)
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
