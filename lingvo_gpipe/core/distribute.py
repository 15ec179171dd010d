"""The trainer's tf.distribute strategies: mirrored replicas or TPU cores.

  strategy = distribute.CreateStrategy('mirrored', num_replicas=2)
  strategy = distribute.CreateStrategy(tpu='my-tpu', num_cores_per_replica=2)
  dataset = distribute.DistributeDataset(strategy, input_gen.GetDataset, 64)
  step = distribute.ReplicatedStep(strategy, task.TrainStep)

As in Lingvo, each replica of the strategy runs the whole training step on
its share of the batch (`strategy.run`): the learner averages the gradients
over the replicas, batch norm merges its moments over them, and every
variable takes the same update, that of one model on the whole batch.

* `--strategy=mirrored`: `tf.distribute.MirroredStrategy` over this host's
  GPUs (or, without a GPU, its virtual CPU devices, `--num_cpu_devices`). A
  replica is one device; a pipeline's K cells all run on its replica's
  device, one micro-batch at a time (re-materialization and micro-batching
  still bound the memory). For K cells on K devices per replica use the
  library's own data parallelism (`--worker_replicas` without a strategy).
* `--tpu=NAME`: `tf.distribute.TPUStrategy` with `--worker_split_size=K`
  cores per replica; cell k of each replica runs on the replica's logical
  core k (see `lingvo_gpipe.core.tpu`).

The input: `DistributeDataset` splits each global batch of the input
generator into consecutive per-replica batches (replica r gets examples
r*B/R .. (r+1)*B/R-1), through `distribute_datasets_from_function`.
"""

import tensorflow as tf

from lingvo_gpipe.core import tpu

__all__ = [
  'STRATEGIES',
  'LocalReplicaDevices',
  'CreateStrategy',
  'CheckBatchSize',
  'DistributeDataset',
  'ReplicatedStep',
  'Describe',
]

STRATEGIES = ('mirrored',)


def LocalReplicaDevices(num_replicas=None):
  """This host's GPUs, or else its (virtual) CPU devices; the first
  `num_replicas` of them (None: all)."""
  devices = [d.name for d in tf.config.list_logical_devices('GPU')]
  if not devices:
    devices = [d.name for d in tf.config.list_logical_devices('CPU')]
  if num_replicas is None:
    return devices
  if num_replicas > len(devices):
    raise ValueError(
      f'--strategy=mirrored with --worker_replicas={num_replicas} needs '
      f'{num_replicas} devices but this host has {len(devices)} '
      f'({devices}). Split the CPU with --num_cpu_devices={num_replicas} '
      '(or a GPU with --num_gpu_devices), or use fewer replicas.'
    )
  return devices[:num_replicas]


def CreateStrategy(
  strategy=None,
  tpu_name=None,
  num_cores_per_replica=1,
  num_replicas=None,
  timeout_s=30.0,
):
  """The strategy the trainer runs under, or None (no strategy).

  Args:
    strategy: None or a name of STRATEGIES (trainer flag --strategy).
    tpu_name: None (no TPU), or what `tpu.CreateTPUStrategy` takes: '' or
      'local' (this TPU VM), a Cloud TPU name, or 'grpc://<ip>:8470'
      (trainer flag --tpu).
    num_cores_per_replica: K, TPU cores (pipeline stages) of one replica
      (--worker_split_size); mirrored replicas are one device each.
    num_replicas: R; None: one per device (mirrored), all that fit (TPU).
    timeout_s: bound on finding the TPU.

  Raises:
    ValueError: both a strategy and a TPU, an unknown strategy, too many
      replicas.
    RuntimeError: no TPU answers for `tpu_name` (see tpu.CreateTPUStrategy).
  """
  if strategy and tpu_name is not None:
    raise ValueError(
      f'--tpu={tpu_name!r} and --strategy={strategy} are both given; --tpu '
      'already runs the trainer under TPUStrategy. Give one of them.'
    )
  if tpu_name is not None:
    return tpu.CreateTPUStrategy(
      tpu_name, num_cores_per_replica or 1, num_replicas, timeout_s
    )
  if not strategy:
    return None
  if strategy not in STRATEGIES:
    raise ValueError(
      f'--strategy={strategy!r} is unknown; use one of {list(STRATEGIES)} '
      '(or --tpu=NAME for TPUStrategy).'
    )
  return tf.distribute.MirroredStrategy(LocalReplicaDevices(num_replicas))


def CheckBatchSize(strategy, global_batch_size):
  """Raises ValueError unless the replicas divide the global batch."""
  n = strategy.num_replicas_in_sync
  if not global_batch_size or global_batch_size % n:
    raise ValueError(
      f'The {n} replicas of {type(strategy).__name__} do not divide the '
      f'batch size {global_batch_size}: each replica must get the same '
      f'number of examples. Use a batch size that is a multiple of {n} '
      '(e.g. --model_params_override="task.input.batch_size : '
      f'{max(n, (global_batch_size or 0) // n * n) or n}") or '
      'another number of replicas (--worker_replicas).'
    )


def DistributeDataset(strategy, dataset_fn, global_batch_size, skip_batches=0):
  """A distributed dataset of per-replica batches.

  Args:
    strategy: the tf.distribute strategy.
    dataset_fn: fn() -> tf.data.Dataset of global batches of
      `global_batch_size` examples (e.g. an input generator's GetDataset).
    global_batch_size: B; each replica gets B / R examples per step.
    skip_batches: global batches to skip first (resuming at a step: a
      distributed iterator cannot be checkpointed, so the position is the
      global step).
  """
  CheckBatchSize(strategy, global_batch_size)

  def Fn(ctx):
    per_replica = ctx.get_per_replica_batch_size(global_batch_size)
    ds = dataset_fn()
    if skip_batches:
      ds = ds.skip(skip_batches)
    if ctx.num_input_pipelines > 1:
      ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    # Consecutive slices of each global batch, one per local replica.
    return ds.rebatch(per_replica, drop_remainder=True)

  return strategy.distribute_datasets_from_function(Fn)


def ReplicatedStep(strategy, step_fn):
  """fn(per-replica batch) -> outputs: `step_fn` run by every replica
  (`strategy.run`), its scalar outputs averaged over the replicas."""

  def Step(batch):
    outputs = strategy.run(step_fn, args=(batch,))
    return tf.nest.map_structure(
      lambda v: strategy.reduce(tf.distribute.ReduceOp.MEAN, v, axis=None),
      outputs,
    )

  return Step


def Describe(strategy):
  """One line: the strategy, its replicas and their devices."""
  if strategy is None:
    return 'No tf.distribute strategy.'
  name = type(strategy).__name__
  n = strategy.num_replicas_in_sync
  if tpu.IsTPUStrategy(strategy):
    return (
      f'{name}: {n} replicas x {tpu.NumCoresPerReplica(strategy)} TPU '
      'cores (cell k of a pipeline on logical core k of each replica).'
    )
  devices = list(strategy.extended.worker_devices)
  return (
    f'{name}: {n} replicas on {devices}, one device each (the cells of a '
    "pipeline run on their replica's device); gradients averaged over them."
  )
