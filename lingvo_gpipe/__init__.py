"""lingvo_gpipe: GPipe pipeline parallelism for TensorFlow 2, Lingvo style."""

import importlib.util as _importlib_util
import sys as _sys


class MissingTensorFlowError(ImportError):
  """TensorFlow is not installed: it comes with an extra of lingvo_gpipe."""


def _OneLine(previous):
  """An excepthook that prints a MissingTensorFlowError nobody caught as one
  line (no traceback: the line says all there is to do), and passes every
  other exception to `previous`."""

  def Hook(kind, value, tb):
    if isinstance(value, MissingTensorFlowError):
      print(f'ImportError: {value}', file=_sys.stderr)
    else:
      previous(kind, value, tb)

  return Hook


# TensorFlow comes as an extra (CPU-only and GPU machines need different
# builds), so a plain `pip install` lacks it: say which extra to install
# instead of failing later with "No module named 'tensorflow'". Only looked
# up, not imported: `planning.balance` runs without TensorFlow. The error is
# still an ImportError for code that catches it; uncaught (a script, the
# trainer, a console script) it prints one line.
if _importlib_util.find_spec('tensorflow') is None:
  _sys.excepthook = _OneLine(_sys.excepthook)
  raise MissingTensorFlowError(
    'lingvo_gpipe needs TensorFlow, which comes with an extra: pip install '
    '"lingvo_gpipe[cpu]" (or "lingvo_gpipe[gpu]" on a GPU machine; in a '
    'checkout: pip install -e ".[cpu]").'
  )
