"""The trainer binary's command-line flags (absl), defined once.

`lingvo_gpipe.trainer` adopts them as its own key flags, so that
`python -m lingvo_gpipe.trainer --help` lists them; trainer_params.py turns
them into the cluster, the strategy and the model Params, and trainer.py
runs the jobs they name.
"""

from absl import flags

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
flags.DEFINE_float(
  'eval_idle_timeout_s',
  600.0,
  'Standalone evaler: exit with status 1 after this many seconds with no '
  'checkpoint in the logdir and no trainer running there (a mistyped or '
  'empty --logdir); it logs the wait when it starts. 0: wait forever.',
  lower_bound=0.0,
)
flags.DEFINE_integer(
  'eval_max_batches', None, 'Evaler: at most this many batches per evaluation.'
)
flags.DEFINE_bool(
  'allow_params_change',
  False,
  "Resume a logdir's checkpoint with Params other than its params.txt's "
  '(e.g. without an override it was trained with), and record the new '
  'ones. Without it such a resume is refused, naming the differing keys; '
  'placement, schedule, max_steps and the save and summary intervals may '
  'always change.',
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
