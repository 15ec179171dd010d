"""Runs a Lingvo model file under real Lingvo and under this library; compares.

  python tools/lingvo_crosscheck.py --model=tools/lingvo_models/fc_pipeline.py \
      --lingvo_python=/path/to/lingvo-venv/bin/python

A model file is written against Lingvo's API (`from lingvo.core import gpipe,
layers`, ...) and defines:

  Params()            the Params of the layer to build;
  Inputs(rng)         its inputs: a list of numpy arrays (None allowed), from
                      the numpy RandomState `rng`;
  Call(layer, *xs)    optional: the outputs (default layer.FPropDefaultTheta).

The tool runs the file as it is under Lingvo 0.12.7 (TF1 graph mode, in the
Python of `--lingvo_python`), which builds the layer with Lingvo's initial
weights and computes the outputs and the gradients of the loss (the sum of
the squares of the floating outputs) with respect to every weight. It then
runs the same file with `lingvo.` changed to `lingvo_gpipe.` under this
library, loads Lingvo's weights into the port by path (the key of each
variable in `layer.vars`, e.g. `cell_0.fc0.w`: the same in both), and
compares outputs and gradients: the largest |port - lingvo| / max|lingvo| of
each tensor must be at most `--rtol` (1e-4). Exit status 1 otherwise, or if a
weight of one side has no counterpart on the other. With `--via_checkpoint`
the weights come from the TF1 checkpoint Lingvo saved, read by
`lingvo_gpipe.core.lingvo_checkpoint.LoadLingvoCheckpoint` (by variable
name, `cell_0/fc0/w/var` -> `pipe/cell_0/fc0/w`).

`--build_venv=DIR` first builds a Lingvo 0.12.7 venv in DIR with a Python
3.10 (`--python310`), the packages of docs/porting_from_lingvo.md, and uses
it. This file runs under both Pythons: it imports neither TensorFlow nor the
library at the top.
"""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

LINGVO_PACKAGES = [
  [
    'tensorflow-cpu==2.9.3',
    'numpy<1.24',
    'protobuf<3.20',
    'sympy',
    'attrs',
    'etils',
    'sentencepiece',
  ],
  [
    '--no-deps',
    'tensorflow-text==2.9.0',
    'tensorflow-hub==0.12.0',
    'lingvo==0.12.7',
    'model-pruning-google-research',
    'graph-compression-google-research',
  ],
]


def _LoadModule(path, text=None, name='lingvo_model'):
  """The model file as a module; `text` replaces its source if given."""
  spec = importlib.util.spec_from_loader(name, loader=None)
  module = importlib.util.module_from_spec(spec)
  module.__file__ = path
  with open(path) as f:
    source = f.read() if text is None else text
  exec(compile(source, path, 'exec'), module.__dict__)  # pylint: disable=exec-used
  return module


def PortedSource(path):
  """The model file with Lingvo's import prefix changed to the library's."""
  with open(path) as f:
    text = f.read()
  return re.sub(r'\blingvo\.', 'lingvo_gpipe.', text)


def _Inputs(model):
  return model.Inputs(np.random.RandomState(1234))


def _Floats(outputs, flatten):
  return [o for o in flatten(outputs) if o is not None and o.dtype.is_floating]


def RunLingvo(model_path, out_path):
  """Lingvo's side (under Lingvo's Python): weights, outputs, gradients."""
  import lingvo.compat as tf  # pylint: disable=g-import-not-at-top

  tf.disable_v2_behavior()
  from absl import flags  # pylint: disable=g-import-not-at-top
  from lingvo.core import py_utils  # pylint: disable=g-import-not-at-top

  flags.FLAGS.mark_as_parsed()  # Lingvo's layers read its flags' defaults.

  model = _LoadModule(model_path)
  graph = tf.Graph()
  with graph.as_default():
    py_utils.GetOrCreateGlobalStepVar()
    layer = model.Params().Instantiate()
    xs = [None if x is None else tf.constant(x) for x in _Inputs(model)]
    call = getattr(model, 'Call', None)
    outs = call(layer, *xs) if call else layer.FPropDefaultTheta(*xs)
    flat_outs = _Floats(outs, tf.nest.flatten)
    loss = tf.add_n([tf.reduce_sum(tf.square(o)) for o in flat_outs])
    items = layer.vars.FlattenItems()
    grads = tf.gradients(loss, [v for _, v in items])
    init = tf.global_variables_initializer()
    saver = tf.train.Saver()
  with tf.Session(graph=graph) as sess:
    sess.run(init)
    values, outputs, grad_values = sess.run(
      [[v for _, v in items], flat_outs, grads]
    )
    saver.save(sess, out_path + '.ckpt', write_meta_graph=False)
  arrays = {}
  for (key, _), value, grad in zip(items, values, grad_values):
    arrays['var/' + key] = value
    arrays['grad/' + key] = grad
  for i, o in enumerate(outputs):
    arrays[f'out/{i}'] = o
  np.savez(out_path, **arrays)


# A gradient smaller than this times the largest one, on both sides, is zero.
ZERO_GRAD = 1e-6


def _RelErr(a, b):
  """max|a - b| / max|b|."""
  if not b.size:
    return 0.0
  scale = float(np.max(np.abs(b)))
  diff = float(np.max(np.abs(a - b)))
  return diff / scale if scale else diff


def RunPort(model_path, ref, checkpoint=None):
  """This library's side: loads Lingvo's weights by path and compares.

  With `checkpoint`, the weights come from Lingvo's TF1 checkpoint through
  `lingvo_checkpoint.LoadLingvoCheckpoint` instead.

  Returns:
    (rows, problems): rows of (name, rel_err); problems: missing weights.
  """
  from lingvo_gpipe.core import quiet_start  # pylint: disable=g-import-not-at-top

  del quiet_start
  from lingvo_gpipe.core import cluster  # pylint: disable=g-import-not-at-top

  cluster.SplitCpu(4)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  model = _LoadModule(model_path, PortedSource(model_path), 'ported_model')
  layer = model.Params().Instantiate()
  items = dict(layer.vars.FlattenItems())
  want = {k[len('var/') :] for k in ref if k.startswith('var/')}
  problems = [
    f'weight {k} of Lingvo has no counterpart' for k in want - set(items)
  ]
  problems += [
    f'weight {k} of the port is not in Lingvo' for k in set(items) - want
  ]
  if checkpoint:
    from lingvo_gpipe.core import lingvo_checkpoint  # pylint: disable=g-import-not-at-top

    lingvo_checkpoint.LoadLingvoCheckpoint(layer, checkpoint)
  for key, var in items.items():
    if key in want and not checkpoint:
      value = ref['var/' + key]
      if list(value.shape) != var.shape.as_list():
        problems.append(
          f'weight {key}: Lingvo {list(value.shape)}, port '
          f'{var.shape.as_list()}'
        )
      else:
        var.assign(value)
  xs = [None if x is None else tf.constant(x) for x in _Inputs(model)]
  call = getattr(model, 'Call', None)
  with tf.GradientTape() as tape:
    outs = call(layer, *xs) if call else layer.FPropDefaultTheta(*xs)
    flat_outs = _Floats(outs, tf.nest.flatten)
    loss = tf.add_n([tf.reduce_sum(tf.square(o)) for o in flat_outs])
  keys = sorted(items)
  grads = tape.gradient(loss, [items[k] for k in keys])
  rows = []
  for i, o in enumerate(flat_outs):
    rows.append((f'output {i}', _RelErr(o.numpy(), ref[f'out/{i}'])))
  # A gradient that is zero in exact arithmetic (e.g. of the keys' bias,
  # which shifts all logits of a query alike) is float rounding noise on
  # both sides: below ZERO_GRAD of the largest gradient on both sides, it
  # counts as zero (error 0, listed as such).
  ref_grads = [ref['grad/' + k] for k in keys if k in want]
  big = max((float(np.max(np.abs(g))) for g in ref_grads), default=0.0)
  for key, g in zip(keys, grads):
    if key not in want:
      continue
    g = np.zeros(items[key].shape) if g is None else np.asarray(g)
    r = ref['grad/' + key]
    both = max(float(np.max(np.abs(g))), float(np.max(np.abs(r))))
    if r.size and both <= ZERO_GRAD * big:
      rows.append(
        (f'grad {key} (zero: |g| <= {both / big:.0e} x largest)', 0.0)
      )
    else:
      rows.append((f'grad {key}', _RelErr(g, r)))
  return rows, problems


def BuildVenv(path, python310):
  """A Lingvo 0.12.7 venv at `path` (minutes; downloads about 600 MB)."""
  subprocess.run([python310, '-m', 'venv', path], check=True)
  pip = os.path.join(path, 'bin', 'pip')
  for args in LINGVO_PACKAGES:
    subprocess.run([pip, 'install', '-q'] + args, check=True)
  return os.path.join(path, 'bin', 'python')


def _Parser():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--model', required=True, help='The model file.')
  parser.add_argument(
    '--lingvo_python',
    default='/tmp/lingvo_venv/bin/python',
    help='Python of a venv with Lingvo 0.12.7 (TF 2.9).',
  )
  parser.add_argument(
    '--build_venv', default=None, help='Build a Lingvo venv here first.'
  )
  parser.add_argument(
    '--python310', default='python3.10', help='Python 3.10 for --build_venv.'
  )
  parser.add_argument('--rtol', type=float, default=1e-4)
  parser.add_argument(
    '--via_checkpoint',
    action='store_true',
    help="Load Lingvo's weights from the TF1 checkpoint Lingvo wrote "
    '(lingvo_checkpoint.LoadLingvoCheckpoint) instead of by key.',
  )
  parser.add_argument('--json', default=None, help='Write the results here.')
  parser.add_argument('--side', default='both', help=argparse.SUPPRESS)
  parser.add_argument('--out', default=None, help=argparse.SUPPRESS)
  return parser


def main(argv=None):
  args = _Parser().parse_args(argv)
  if args.side == 'lingvo':
    RunLingvo(args.model, args.out)
    return 0
  if not os.path.exists(args.model):
    print(f'ERROR: model file {args.model!r} does not exist.')
    return 1
  lingvo_python = args.lingvo_python
  if args.build_venv:
    lingvo_python = BuildVenv(args.build_venv, args.python310)
  if not os.path.exists(lingvo_python):
    print(
      f'ERROR: --lingvo_python={lingvo_python!r} does not exist; give the '
      'Python of a Lingvo 0.12.7 venv, or --build_venv=DIR to build one.'
    )
    return 1
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, 'lingvo.npz')
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
    env.pop('PYTHONPATH', None)
    proc = subprocess.run(
      [lingvo_python, os.path.abspath(__file__), '--side=lingvo']
      + [f'--model={os.path.abspath(args.model)}', f'--out={out}'],
      env=env,
      capture_output=True,
      text=True,
      check=False,
    )
    if proc.returncode:
      print(proc.stderr[-3000:])
      print(f'ERROR: the model failed under Lingvo ({lingvo_python}).')
      return 1
    ref = dict(np.load(out))
    checkpoint = out + '.ckpt' if args.via_checkpoint else None
    rows, problems = RunPort(args.model, ref, checkpoint)
  worst = max((e for _, e in rows), default=0.0)
  for name, err in rows:
    print(f'{err:10.2e}  {name}')
  for p in problems:
    print(f'ERROR: {p}')
  ok = not problems and worst <= args.rtol
  print(
    f'{os.path.basename(args.model)}: {len(rows)} tensors, largest relative '
    f'difference {worst:.2e} (tolerance {args.rtol:g}): '
    + ('OK' if ok else 'FAILED')
  )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(
        dict(
          model=args.model, worst=worst, ok=ok, rows=rows, problems=problems
        ),
        f,
        indent=1,
      )
  return 0 if ok else 1


if __name__ == '__main__':
  sys.exit(main())
