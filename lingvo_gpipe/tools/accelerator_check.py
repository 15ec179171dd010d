r"""Checks the library on this host's GPU: the paths the CPU tests cannot reach.

  python tools/accelerator_check.py                 # report on stdout
  python tools/accelerator_check.py --json=/tmp/accel.json

On a host where TensorFlow sees a GPU it splits the first GPU into 2 logical
GPUs (--gpu_memory_limit_mb each) and runs, in order:
  1. transparency: a K=2 pipeline over the 2 logical GPUs against the same
     model as K=1 on one of them (same variable names, so the same initial
     weights): outputs and gradients must agree to float32 tolerance;
  2. mixed precision: the same with the layers computing in float16 (loss
     scaled by --loss_scale, gradients unscaled) and in bfloat16; the
     gradients must be finite and near the float32 ones;
  3. the trainer: --trainer_steps steps of AmoebaNetTiny and TransformerTiny
     with --run_locally=gpu --num_gpu_devices=2 --worker_split_size=2 (each a
     subprocess; its last lines are kept on failure);
  4. the pipeline benchmark in-process on the 2 logical GPUs (K=1 and K=2).
It prints a short report naming the GPU, one line per check. Without a GPU it
says so and exits 0 with nothing run. Exit status: 1 if a check failed.

Not yet run on a GPU or TPU: only the no-GPU path and the transparency and
mixed-precision checks (on virtual CPU devices) are tested
(tests/tools/accelerator_check_test.py).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# The folder that holds lingvo_gpipe/ (a checkout, or site-packages): the
# trainer's subprocess imports the same package as this process.
_ROOT = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
from lingvo_gpipe.core import quiet_start  # pylint: disable=g-import-not-at-top

quiet_start.ImportTensorFlow(min_log_level='2')

import numpy as np  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from lingvo_gpipe.core import cluster  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.core import layers  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.pipeline import pipelining_layer  # pylint: disable=g-import-not-at-top
from lingvo_gpipe.tools import benchmark_pipeline  # pylint: disable=g-import-not-at-top

TRAINER_MODELS = (
  'image.amoebanet.AmoebaNetTiny',
  'mt.multilingual.TransformerTiny',
)


def GpuName():
  """The first GPU's name as TensorFlow reports it, or None without a GPU."""
  gpus = tf.config.list_physical_devices('GPU')
  if not gpus:
    return None
  details = tf.config.experimental.get_device_details(gpus[0]) or {}
  return details.get('device_name', gpus[0].name)


def _Layers(dim, num_layers, fprop_dtype=None):
  return [
    layers.FCLayer.Params().Set(
      name=f'fc_{i}',
      input_dim=dim,
      output_dim=dim,
      activation='TANH',
      fprop_dtype=fprop_dtype,
    )
    for i in range(num_layers)
  ]


def _LossAndGrads(
  devices,
  num_stages,
  fprop_dtype=None,
  loss_scale=1.0,
  batch=8,
  dim=16,
  num_layers=4,
  num_micro_batches=4,
):
  """Loss and gradients (float32 numpy) of an FC stack as a pipeline."""
  pipe = (
    pipelining_layer.PipeliningLayer.Params()
    .Set(
      name='pipe',
      layers=_Layers(dim, num_layers, fprop_dtype),
      num_stages=num_stages,
      num_micro_batches=num_micro_batches,
      devices=devices[:num_stages],
      input_shapes=[[batch, dim]],
      fprop_dtype=fprop_dtype,
    )
    .Instantiate()
  )
  rng = np.random.RandomState(0)
  x = tf.constant(rng.randn(batch, dim).astype(np.float32))
  w = tf.constant(rng.randn(batch, dim).astype(np.float32))
  variables = pipe.trainable_variables

  @tf.function
  def Step(x):
    with tf.GradientTape() as tape:
      out = tf.cast(pipe(x), tf.float32)
      loss = tf.reduce_sum(out * w)
      scaled = loss * loss_scale
    grads = tape.gradient(scaled, variables)
    return loss, [tf.cast(g, tf.float32) / loss_scale for g in grads]

  loss, grads = Step(x)
  return float(loss), {v.name: g.numpy() for v, g in zip(variables, grads)}


def _MaxRelDiff(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def CheckTransparency(devices):
  """K=2 over devices[:2] against K=1 on devices[0]; returns (ok, detail)."""
  loss1, g1 = _LossAndGrads(devices, 1)
  loss2, g2 = _LossAndGrads(devices, 2)
  diff = max(
    [_MaxRelDiff(loss2, loss1)] + [_MaxRelDiff(g2[n], g1[n]) for n in g1]
  )
  return diff <= 1e-4, f'max relative difference {diff:.2e} (tolerance 1e-4)'


def CheckMixedPrecision(devices, dtype, loss_scale):
  """K=2 computing in `dtype` against float32; returns (ok, detail)."""
  _, ref = _LossAndGrads(devices, 2)
  scale = loss_scale if dtype == tf.float16 else 1.0
  _, got = _LossAndGrads(devices, 2, fprop_dtype=dtype, loss_scale=scale)
  finite = all(np.all(np.isfinite(g)) for g in got.values())
  diff = max(_MaxRelDiff(got[n], ref[n]) for n in ref)
  return finite and diff <= 0.05, (
    f'gradients finite: {finite}, max relative difference to float32 '
    f'{diff:.2e} (tolerance 5e-2), loss scale {scale:g}'
  )


def CheckTrainer(model, steps, memory_limit_mb, timeout_s):
  """Runs the trainer on the logical GPUs in a subprocess."""
  with tempfile.TemporaryDirectory() as logdir:
    cmd = [
      sys.executable,
      '-m',
      'lingvo_gpipe.trainer',
      f'--model={model}',
      f'--logdir={logdir}',
      '--run_locally=gpu',
      '--num_gpu_devices=2',
      f'--gpu_memory_limit_mb={memory_limit_mb}',
      '--worker_split_size=2',
      f'--max_steps={steps}',
    ]
    env = dict(
      os.environ,
      PYTHONPATH=_ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''),
    )
    start = time.time()
    try:
      r = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
        check=False,
      )
    except subprocess.TimeoutExpired:
      return False, f'no exit after {timeout_s:.0f} s'
    if r.returncode != 0:
      tail = ' | '.join((r.stderr or r.stdout).strip().splitlines()[-3:])
      return False, f'exit status {r.returncode}: {tail}'
    return True, f'{steps} steps in {time.time() - start:.0f} s'


def CheckBenchmark(devices):
  """The pipeline benchmark in-process on the logical GPUs."""
  args = argparse.Namespace(
    model='transformer',
    configs='0x1x0,1x1x0,2x4x0,2x4x1',
    num_blocks=4,
    dim=256,
    seq_len=64,
    batch_size=32,
    steps=3,
    warmup=1,
    strict_order=1,
  )
  records = benchmark_pipeline.RunBenchmark(args, devices)
  return True, '\n' + benchmark_pipeline.Table(records)


def RunChecks(args, devices):
  """Runs every check; returns [(name, ok, detail)]."""
  checks = [
    ('transparency K=2 vs K=1', lambda: CheckTransparency(devices)),
    (
      'float16 compute, loss scaling',
      lambda: CheckMixedPrecision(devices, tf.float16, args.loss_scale),
    ),
    (
      'bfloat16 compute',
      lambda: CheckMixedPrecision(devices, tf.bfloat16, 1.0),
    ),
  ]
  if not args.skip_trainer:
    for model in TRAINER_MODELS:
      checks.append(
        (
          f'trainer {model}',
          lambda m=model: CheckTrainer(
            m,
            args.trainer_steps,
            args.gpu_memory_limit_mb,
            args.trainer_timeout_s,
          ),
        )
      )
  if not args.skip_benchmark:
    checks.append(('benchmark in-process', lambda: CheckBenchmark(devices)))
  results = []
  for name, check in checks:
    try:
      ok, detail = check()
    except Exception as e:  # pylint: disable=broad-except
      ok, detail = False, f'{type(e).__name__}: {str(e).splitlines()[0]}'
    results.append((name, ok, detail))
    print(f'{"ok  " if ok else "FAIL"} {name}: {detail}', flush=True)
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    '--gpu_memory_limit_mb',
    type=int,
    default=4096,
    help='Memory of each of the 2 logical GPUs.',
  )
  parser.add_argument('--trainer_steps', type=int, default=50)
  parser.add_argument('--trainer_timeout_s', type=float, default=900.0)
  parser.add_argument('--loss_scale', type=float, default=2.0**12)
  parser.add_argument('--skip_trainer', action='store_true')
  parser.add_argument('--skip_benchmark', action='store_true')
  parser.add_argument('--json', default='', help='Write the report here.')
  args = parser.parse_args(argv)

  name = GpuName()
  if name is None:
    print(
      'No accelerator: TensorFlow finds no GPU '
      "(tf.config.list_physical_devices('GPU') is empty); nothing run. "
      'For a TPU, see docs/tpu.md.'
    )
    return 0
  print(
    f'Device: {name} (TensorFlow {tf.__version__}), split into 2 logical '
    f'GPUs of {args.gpu_memory_limit_mb} MB',
    flush=True,
  )
  cluster.SplitGpu(2, args.gpu_memory_limit_mb)
  devices = ['/device:GPU:0', '/device:GPU:1']
  results = RunChecks(args, devices)
  failed = [n for n, ok, _ in results if not ok]
  print(
    f'{len(results) - len(failed)}/{len(results)} checks passed'
    + (f'; failed: {", ".join(failed)}' if failed else '')
  )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(
        {
          'device': name,
          'tensorflow': tf.__version__,
          'checks': [
            {'name': n, 'ok': ok, 'detail': d} for n, ok, d in results
          ],
        },
        f,
        indent=1,
      )
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
