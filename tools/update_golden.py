r"""Writes the golden variable files of the registered models.

  python tools/update_golden.py                      # every model
  python tools/update_golden.py --model=image.digits.MlpDigitsTiny
  python tools/update_golden.py --check              # exit 1 on a drift

`tests/golden/<model key>.json` holds the name, shape and dtype of every
variable of a registered model (its Train Params), built abstractly
(`base_layer.AbstractBuild`: no weight is allocated, so the 2-billion-weight
models take seconds). Names never depend on the number of pipeline stages, so
these files pin what a checkpoint of each model holds: tests/golden_test.py
fails when a change renames, reshapes or retypes a variable, which would
break restoring an older checkpoint. Regenerate a file on purpose only, when
the change to the model is meant, and say so in the commit.
"""

import argparse
import difflib
import json
import os
import sys

from lingvo_gpipe import model_registry
from lingvo_gpipe.core import base_layer

GOLDEN_DIR = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  'tests',
  'golden',
)


def ModelKeys():
  """The keys of the models registered under the `params` package."""
  model_registry.ImportAllParams()
  return sorted(
    key
    for key, cls in model_registry.GetAllRegisteredClasses().items()
    if cls.__module__.startswith(model_registry.PARAMS_PACKAGE + '.')
  )


def Variables(p):
  """{name: [shape, dtype name]} of the model of Params `p`, built abstractly.

  Args:
    p: a model's Params.

  Returns:
    A dict sorted by variable name.
  """
  with base_layer.AbstractBuild(), base_layer.DetachedBuild():
    model = p.Copy().Instantiate()
  return {
    name: [v.shape.as_list(), v.dtype.base_dtype.name]
    for name, v in sorted(model.VariablesByName().items())
  }


def GoldenPath(key, golden_dir=GOLDEN_DIR):
  return os.path.join(golden_dir, f'{key}.json')


def GoldenText(key, variables):
  """The golden file's text: one variable per line, so diffs stay readable."""
  lines = [
    f'    {json.dumps(name)}: {json.dumps(spec)}'
    for name, spec in variables.items()
  ]
  return (
    '{\n'
    f'  "model": {json.dumps(key)},\n'
    '  "variables": {\n' + ',\n'.join(lines) + '\n  }\n}\n'
  )


def ReadGolden(key, golden_dir=GOLDEN_DIR):
  """{name: [shape, dtype]} of the golden file of `key`, or None if none."""
  path = GoldenPath(key, golden_dir)
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return json.load(f)['variables']


def Drift(key, golden_dir=GOLDEN_DIR):
  """'' if model `key` matches its golden file, else what differs."""
  want = ReadGolden(key, golden_dir)
  got = Variables(model_registry.GetParams(key, 'Train'))
  if want is None:
    return f'{GoldenPath(key, golden_dir)} does not exist.'
  if want == got:
    return ''
  diff = difflib.unified_diff(
    GoldenText(key, want).splitlines(),
    GoldenText(key, got).splitlines(),
    'golden',
    'model',
    lineterm='',
    n=0,
  )
  return '\n'.join(list(diff)[:40])


def Write(key, golden_dir=GOLDEN_DIR):
  """Writes the golden file of model `key`; returns its path."""
  os.makedirs(golden_dir, exist_ok=True)
  path = GoldenPath(key, golden_dir)
  text = GoldenText(key, Variables(model_registry.GetParams(key, 'Train')))
  with open(path, 'w', encoding='utf-8') as f:
    f.write(text)
  return path


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    '--model',
    action='append',
    default=[],
    help='A registered model key (repeatable); default: every model.',
  )
  parser.add_argument(
    '--check',
    action='store_true',
    help='Write nothing; exit 1 if a model differs from its golden file.',
  )
  args = parser.parse_args(argv)
  keys = ModelKeys()
  unknown = sorted(set(args.model) - set(keys))
  if unknown:
    print(
      f'ERROR: unknown model keys {unknown}; registered: {keys}',
      file=sys.stderr,
    )
    return 1
  failed = False
  for key in args.model or keys:
    if args.check:
      drift = Drift(key)
      if drift:
        failed = True
        print(f'{key} drifted:\n{drift}')
    else:
      print(f'Wrote {Write(key)}')
  if not args.check and not args.model:
    stale = sorted(
      f
      for f in os.listdir(GOLDEN_DIR)
      if f.endswith('.json') and f[: -len('.json')] not in keys
    )
    for f in stale:
      os.remove(os.path.join(GOLDEN_DIR, f))
      print(f'Removed {f} (no such registered model)')
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
