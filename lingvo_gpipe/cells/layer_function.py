"""Identical layers of a pipeline as one function, traced once per kind.

A cell's functions (`cell_function`) are traced once per cell, but each
holds every op of every layer of its cell: a deep model of 24 identical
Transformer layers per cell still writes 24 copies of a layer into each
cell's forward and backward, and TensorFlow traces, optimizes and ships
them all. Here each *kind* of layer (the same class and the same Params,
but for the name) is traced once into a function of its weights, inputs
and seeds, and each layer of that kind is one call of it inside the cell's
functions. The cell's backward differentiates these calls as TensorFlow
differentiates any function: a forward that keeps what the gradient needs,
and one backward function per kind.

The calls are `_noinline`, like the cells', so that TensorFlow's graph
optimizations keep one copy of the layer, not one per call.

A layer computes exactly what it computes inline:
- its weights, inputs, the step seed and the eval mode cross the function
  boundary explicitly;
- its random ops' layer seeds (Python ints derived from each layer's name,
  `py_utils.GenerateStepSeedPair`) become an argument: the representative's
  trace finds which sub-layer attribute holds each seed, and each layer
  passes its own;
- its deferred updates (batch-norm statistics) are outputs, handed to the
  enclosing collector under the calling layer's own sub-layer.

A kind runs inline where a call would cost more than it saves: with
`share_layer_functions='auto'`, a kind of fewer than
`AUTO_MIN_OPS` ops. And it runs inline where the numbers cannot be kept
exact: the trace captures a tensor or variable from outside (a
layer that reads its variables directly instead of through theta), a seed
is not found among the sub-layers' attributes, an input or output is not a
tensor, or the layers' weights differ in shape.
"""

import collections
import weakref

import tensorflow as tf

from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import graph_ops
from lingvo_gpipe.core import py_utils

__all__ = ['KindKey', 'SharedLayers']

# A kind is shared only where at least this many layers have it.
_MIN_LAYERS = 2

# With 'auto', a kind is shared only where its forward is at least this many
# ops (Placeholder, Identity, NoOp and Const not counted). A call costs about
# as much as 3.5 small ops run inline (12 us against 3.4 us per op on this
# CPU), so a kind of 48 ops or more (a Transformer block: 56 to 66) pays at
# most 7% of its ops' run-time overhead for its calls, and less where its
# ops compute; a dense layer (3 ops), a batch norm (19) or a dropout (28)
# costs little to trace and runs inline.
AUTO_MIN_OPS = 48

# Ops that a function body has whatever it computes.
_PLUMBING = ('Placeholder', 'Identity', 'NoOp', 'Const')


def _Sublayers(layer, prefix=()):
  """[(relative path, sub-layer)] of `layer` and its descendants, in
  construction order."""
  out = [(prefix, layer)]
  for name, child in layer.__dict__.get('_private_children', {}).items():
    if isinstance(child, (list, tuple)):
      for i, c in enumerate(child):
        out += _Sublayers(c, prefix + ((name, i),))
    else:
      out += _Sublayers(child, prefix + ((name, None),))
  return out


def KindKey(layer):
  """What a layer computes: layers of one kind have one class and the same
  Params but for the name."""
  p = layer.params.Copy()
  p.name = ''
  return (type(layer), p.ToText())


def _Spec(t):
  return (tuple(t.shape.as_list()), t.dtype.name)


class _Kind:
  """One traced layer function and what its trace found."""

  def __init__(self):
    self.fn = None  # the concrete function
    self.out = None  # the output structure (a tuple of tensors)
    self.seeds = []  # [(relative path, attribute)] of each seed, in order
    self.updates = []  # [(relative path, stats structure)]
    self.ok = True


class SharedLayers:
  """Runs each layer of a shared kind as a call of its kind's function.

  Args:
    layers: all the layers of the pipeline's body.
    min_ops: share only kinds whose forward has at least this many ops
      (other kinds run inline).
  """

  def __init__(self, layers, min_ops=0):
    self._min_ops = min_ops
    counts = collections.Counter(KindKey(l) for l in layers)
    self._kinds = {
      id(l): KindKey(l) for l in layers if counts[KindKey(l)] >= _MIN_LAYERS
    }
    # {graph: {key: _Kind}}: the functions of each step graph.
    self._graphs = weakref.WeakKeyDictionary()
    self._refused = set()  # kind keys that cannot be shared

  def Shared(self, layer):
    """Whether `layer` runs as a call of its kind's function."""
    key = self._kinds.get(id(layer))
    return key is not None and key not in self._refused

  def FProp(self, layer, theta, args):
    """layer.FProp(theta, *args), as a call where its kind is shared."""
    if not self.Shared(layer) or tf.executing_eagerly():
      return layer.FProp(theta, *args)
    flat_theta = tf.nest.flatten(theta)
    flat_args = tf.nest.flatten(args)
    if not all(py_utils.IsTensor(t) for t in flat_theta + flat_args):
      return layer.FProp(theta, *args)
    is_eval = py_utils.IsEval()
    key = (
      self._kinds[id(layer)],
      is_eval,
      repr(tf.nest.map_structure(lambda _: 0, (theta, tuple(args)))),
      tuple(_Spec(t) for t in flat_theta + flat_args),
    )
    kind = self._Get(key, layer, theta, args, is_eval)
    if not kind.ok:
      return layer.FProp(theta, *args)
    subs = {path: sub for path, sub in _Sublayers(layer)}
    seeds = [getattr(subs[path], attr) for path, attr in kind.seeds]
    # Opaque: a constant argument would let the graph optimizer specialize
    # the function once per call.
    seed_t = graph_ops.Opaque(tf.constant(seeds, tf.int64, shape=[len(seeds)]))
    step_seed = py_utils.CurrentStepSeed()
    inputs = flat_theta + flat_args + [step_seed, seed_t]
    if _tf_internal.ShouldRecordBackprop(inputs):
      flat = list(kind.fn(*inputs))
    else:
      flat = _tf_internal.CallFunction(kind.fn, inputs)
    n_out = len(tf.nest.flatten(kind.out))
    out = tf.nest.pack_sequence_as(kind.out, flat[:n_out])
    rest = flat[n_out:]
    for path, stats in kind.updates:
      n = len(tf.nest.flatten(stats))
      py_utils.AddDeferredUpdate(
        subs[path], tf.nest.pack_sequence_as(stats, rest[:n])
      )
      rest = rest[n:]
    return out

  def _Get(self, key, layer, theta, args, is_eval):
    graph = tf.compat.v1.get_default_graph()
    while hasattr(graph, 'outer_graph') and graph.outer_graph is not None:
      graph = graph.outer_graph
    kinds = self._graphs.setdefault(graph, {})
    if key not in kinds:
      kinds[key] = self._Trace(layer, theta, args, is_eval)
      if not kinds[key].ok:
        self._refused.add(key[0])
    return kinds[key]

  def _Trace(self, layer, theta, args, is_eval):
    kind = _Kind()
    subs = _Sublayers(layer)
    n_theta = len(tf.nest.flatten(theta))
    n_args = len(tf.nest.flatten(args))
    seen_seeds = []

    @_tf_internal.WithSharedConstants
    def Body(*tensors):
      th = tf.nest.pack_sequence_as(theta, tensors[:n_theta])
      xs = tf.nest.pack_sequence_as(args, tensors[n_theta : n_theta + n_args])
      step_seed, layer_seeds = tensors[n_theta + n_args :]

      def Seed(s):
        seen_seeds.append(s)
        return layer_seeds[len(seen_seeds) - 1]

      with (
        py_utils.EvalMode(is_eval),
        py_utils.StepSeed(step_seed),
        py_utils.LayerSeedMap(Seed),
        py_utils.UpdateCollector() as collector,
      ):
        out = py_utils.AsTuple(layer.FProp(th, *xs))
      kind.out = out
      kind.updates = list(collector.updates)
      return tf.nest.flatten(out) + tf.nest.flatten(
        [s for _, s in collector.updates]
      )

    specs = [
      tf.TensorSpec(t.shape, t.dtype)
      for t in tf.nest.flatten(theta) + tf.nest.flatten(args)
    ] + [tf.TensorSpec([], tf.int64), tf.TensorSpec([None], tf.int64)]
    fn = py_utils.OutOfLineFunction(Body).get_concrete_function(*specs)
    kind.fn = fn
    ops = [o for o in fn.graph.get_operations() if o.type not in _PLUMBING]
    if len(ops) < self._min_ops:
      kind.ok = False
      return kind
    if fn.captured_inputs or not all(
      py_utils.IsTensor(t) for t in tf.nest.flatten(kind.out)
    ):
      kind.ok = False
      return kind
    # Where each seed lives: the sub-layer attribute that holds it.
    for s in seen_seeds:
      where = [
        (path, attr)
        for path, sub in subs
        for attr, v in vars(sub).items()
        if type(v) is int and v == s  # noqa: E721 (not a bool)
      ]
      if len(where) != 1:
        kind.ok = False
        return kind
      kind.seeds.append(where[0])
    paths = {id(sub): path for path, sub in subs}
    ups = []
    for sub, stats in kind.updates:
      if id(sub) not in paths:
        kind.ok = False
        return kind
      ups.append((paths[id(sub)], stats))
    kind.updates = ups
    return kind
