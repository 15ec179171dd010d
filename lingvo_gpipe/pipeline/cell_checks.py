"""Checks on a pipeline's traced cell functions (`cell_function.py`).

`TraceCounter` tells when a cell is traced more often than the step needs;
`XlaCheck` finds, when an XLA-compiled cell is first traced, a layer whose
ops XLA cannot compile, and names it.
"""

import collections
import re

from absl import logging
import tensorflow as tf

__all__ = ['TraceCounter', 'XlaCheck']

# Traces of one function for one input signature, over all graphs, after
# which a warning says the step is probably traced anew each step.
_RETRACE_WARNING = 3


class TraceCounter:
  """Counts each cell function's traces per input signature.

  A function is traced once per signature in each graph that calls it; a
  second signature (e.g. a batch of another size) is one more trace, said
  once at INFO. The same signature traced again, in the same graph or in
  `_RETRACE_WARNING` graphs, means the step is being rebuilt: a warning.
  """

  def __init__(self, name):
    self._name = name
    self._counts = collections.Counter()
    self._warned = set()

  def Count(self, f, k, kind, key, tensors):
    """Warns when a cell's function is traced again for inputs it was
    already traced for: the step that calls it is then being rebuilt (e.g.
    a new tf.function at every step), which costs a trace each time."""
    if 'mark' in f.meta:  # The XLA check's trace, not a call's.
      return
    sig = tuple((tuple(t.shape.as_list()), t.dtype.name) for t in tensors)
    f.traces[sig] += 1
    self._counts[(key, sig)] += 1
    n = self._counts[(key, sig)]
    if len(f.traces) == 2 and (key, 'shapes') not in self._warned:
      self._warned.add((key, 'shapes'))
      logging.info(
        'Pipeline %r cell %d (%s) traced once more, for inputs of other '
        'shapes (%s); each distinct input signature is one trace.',
        self._name,
        k,
        kind,
        ', '.join(str(list(s)) for s, _ in sig),
      )
    if (f.traces[sig] > 1 or n >= _RETRACE_WARNING) and (
      key,
      'again',
    ) not in self._warned:
      self._warned.add((key, 'again'))
      logging.warning(
        'Pipeline %r cell %d (%s) was traced %d times for the same input '
        'shapes: the step that calls it is being rebuilt (e.g. a new '
        'tf.function at every step). Trace the step once and call it.',
        self._name,
        k,
        kind,
        n,
      )


class XlaCheck:
  """Converts an XLA-compiled cell to HLO once per input signature: an op
  that XLA cannot compile is reported naming the layer that made it.

  Args:
    cell_layers: fn(k) -> the layers of cell k.
    name: the pipeline's path, for messages.
  """

  def __init__(self, cell_layers, name):
    self._cell_layers = cell_layers
    self._name = name
    self._checked = set()

  def Check(self, k, f, tensors, key):
    """Converts the cell to HLO once per input signature: an op that XLA
    cannot compile is reported naming the layer that made it."""
    key = key + (tuple((tuple(t.shape), t.dtype) for t in tensors),)
    if key in self._checked:
      return
    self._checked.add(key)
    marks = []

    def Mark(layer):
      graph = tf.compat.v1.get_default_graph()
      marks.append((layer, len(graph.get_operations()), graph))

    specs = [tf.TensorSpec(t.shape, t.dtype) for t in tensors]
    f.meta['mark'] = Mark
    try:
      with tf.init_scope():
        f.fn.experimental_get_compiler_ir(*specs)(stage='hlo')
    except Exception as e:  # pylint: disable=broad-except
      text = str(e)
      if 'unsupported operations' not in text and 'No registered' not in text:
        logging.warning(
          'Pipeline %r cell %d: could not check that XLA compiles it (%s).',
          self._name,
          k,
          text.splitlines()[0][:300] if text else type(e).__name__,
        )
        return
      self._RaiseUnsupported(k, text, marks)
    finally:
      f.meta.pop('mark', None)

  def _RaiseUnsupported(self, k, text, marks):
    ops = re.findall(r"No registered '([A-Za-z0-9_]+)' OpKernel", text)
    ops = list(dict.fromkeys(ops))
    culprit = None
    if marks:
      graph = marks[0][2]
      all_ops = graph.get_operations()
      bounds = [m[1] for m in marks[1:]] + [len(all_ops)]
      for (layer, start, _), end in zip(marks, bounds):
        if any(op.type in ops for op in all_ops[start:end]):
          culprit = layer
          break
    layers = self._cell_layers(k)
    where = (
      f'layer {culprit.path!r}'
      if culprit is not None
      else 'one of its layers (' + ', '.join(lyr.path for lyr in layers) + ')'
    )
    raise ValueError(
      f'Pipeline {self._name!r} has jit_compile=True but XLA cannot compile '
      f'cell {k}: {where} uses {", ".join(ops) or "an op"} that XLA has no '
      f'kernel for. Set jit_compile=False on the pipeline (e.g. '
      f'--model_params_override="<path to the pipeline>.jit_compile : '
      'False"), or replace the layer.'
    )
