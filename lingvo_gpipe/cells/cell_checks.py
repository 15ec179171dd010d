"""Checks on a pipeline's traced cell functions (`cell_function.py`).

`TraceCounter` tells when a cell is traced more often than the step needs;
`XlaCheck` finds, when an XLA-compiled cell is first traced, a layer with
an op that XLA has no kernel for, and names it; `WarnStatefulRandom` warns
of a re-materialized cell that draws random numbers with stateful ops.
"""

import collections

from absl import logging
import tensorflow as tf

from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import py_utils

__all__ = ['TraceCounter', 'WarnStatefulRandom', 'XlaCheck']

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


# Random ops that draw from a generator's state: run twice, they draw other
# values (the stateless ones take a seed and draw the same).
_STATEFUL_RANDOM = frozenset(
  {
    'Multinomial',
    'ParameterizedTruncatedNormal',
    'RandomGamma',
    'RandomPoisson',
    'RandomPoissonV2',
    'RandomShuffle',
    'RandomStandardNormal',
    'RandomUniform',
    'RandomUniformInt',
    'StatefulRandomBinomial',
    'StatefulStandardNormal',
    'StatefulStandardNormalV2',
    'StatefulTruncatedNormal',
    'StatefulUniform',
    'StatefulUniformFullInt',
    'StatefulUniformInt',
    'TruncatedNormal',
  }
)


def WarnStatefulRandom(name, k, f, concrete):
  """Warns once per function when the recompute-and-backward function `f`
  (`concrete()`: its concrete function, made only the first time: this
  runs at every backward call) of cell k holds a stateful random op.

  The backward pass re-runs the cell's forward, and a stateful random op
  (an unseeded `tf.random.uniform`, `tf.nn.dropout`) then draws other
  values than the forward pass did: the gradients are not those of the
  outputs the step computed. Stateless ops, given the micro-batch's seed,
  draw the same (`layers/dropout.py`).
  """
  if 'stateful_random' in f.meta:
    return
  nodes = py_utils.NodeDefs(concrete().graph)
  found = sorted({n.name for n in nodes if n.op in _STATEFUL_RANDOM})
  f.meta['stateful_random'] = found
  if found:
    logging.warning(
      'Pipeline %r cell %d draws random numbers with stateful ops (%s): '
      'its re-materialization in the backward pass draws other values '
      'than its forward pass, so its gradients do not match its outputs. '
      'Use stateless random ops with the step seed (e.g. DropoutLayer), '
      "or recompute='never'.",
      name,
      k,
      ', '.join(found[:3]) + (', ...' if len(found) > 3 else ''),
    )


# Ops that XLA compiles without a kernel of their own: a function's inputs,
# function calls and functional control flow (whose bodies are checked op
# by op as functions of the library).
_STRUCTURAL = frozenset(
  {
    'Placeholder',
    'NoOp',
    'PartitionedCall',
    'StatefulPartitionedCall',
    'While',
    'StatelessWhile',
    'If',
    'StatelessIf',
    'Case',
    'StatelessCase',
  }
)


def _DeviceType(tensors):
  """The device type ('CPU', 'GPU') that a call on `tensors` runs on."""
  for t in tensors:
    if t.device:
      return tf.DeviceSpec.from_string(t.device).device_type or 'CPU'
  return 'GPU' if tf.config.list_logical_devices('GPU') else 'CPU'


class XlaCheck:
  """Checks an XLA-compiled cell once per input signature, when it is first
  traced: an op that XLA has no kernel for is reported naming the layer
  that made it.

  The check reads the call's own trace, op by op (those of the functions it
  calls too), against the XLA kernels registered for the cell's device type
  and each kernel's dtypes: it needs no device of the cell's (a cell on
  another process is checked in this one) and costs a fraction of
  converting the cell to HLO. Only where it finds an op is the cell traced
  once more with its layers inline, to find the layer of the op. What an op
  with a kernel may still refuse at compile time (e.g. a shape computed
  from data) is XLA's own error at the first step.

  Args:
    cell_layers: fn(k) -> the layers of cell k.
    name: the pipeline's path, for messages.
  """

  def __init__(self, cell_layers, name):
    self._cell_layers = cell_layers
    self._name = name
    self._checked = set()
    self._supported = {}  # {(device type, op, dtype attrs): bool}
    self._warned = False

  def Check(self, k, f, tensors, key):
    """Checks cell k's function `f` on `tensors` once per input signature;
    raises a ValueError naming the layer of an op XLA cannot compile."""
    key = key + (tuple((tuple(t.shape), t.dtype) for t in tensors),)
    if key in self._checked:
      return
    self._checked.add(key)
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in tensors]
    device_type = _DeviceType(tensors)
    with tf.init_scope():
      graph = f.fn.get_concrete_function(*specs).graph
    bad = []
    for node in py_utils.NodeDefs(graph):
      ok = self._Supported(device_type, node)
      if ok is None:
        return
      if not ok and node.op not in bad:
        bad.append(node.op)
    if bad:
      self._RaiseUnsupported(k, bad, self._Marks(f, specs))

  def _Supported(self, device_type, node):
    """Whether XLA has a kernel for `node` (None: unknown here)."""
    if node.op in _STRUCTURAL:
      return True
    attrs = tuple(
      sorted(
        (name, v.type if v.HasField('type') else tuple(v.list.type))
        for name, v in node.attr.items()
        if v.HasField('type') or v.list.type
      )
    )
    memo = (device_type, node.op, attrs)
    if memo not in self._supported:
      kernels = _tf_internal.XlaKernelConstraints(node.op, device_type)
      if kernels is None:
        if not self._warned:
          self._warned = True
          logging.warning(
            'Pipeline %r: could not check that XLA compiles its cells (no '
            'XLA kernels known for %s devices in this process).',
            self._name,
            device_type,
          )
        return None
      given = dict(attrs)
      self._supported[memo] = any(
        all(
          name not in given
          or all(
            tf.as_dtype(t) in allowed
            for t in (
              given[name] if isinstance(given[name], tuple) else (given[name],)
            )
          )
          for name, allowed in kernel.items()
        )
        for kernel in kernels
      )
    return self._supported[memo]

  @staticmethod
  def _Marks(f, specs):
    """[(layer, number of ops before it, graph)] of a trace of f's body
    with its layers inline, each marked where it starts."""
    marks = []

    def Mark(layer):
      graph = tf.compat.v1.get_default_graph()
      marks.append((layer, len(graph.get_operations()), graph))

    f.meta['mark'] = Mark
    try:
      with tf.init_scope():
        tf.function(f.body, autograph=False).get_concrete_function(*specs)
    except Exception:  # pylint: disable=broad-except
      pass  # The layer is then not named; the op still is.
    finally:
      f.meta.pop('mark', None)
    return marks

  def _RaiseUnsupported(self, k, ops, marks):
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
