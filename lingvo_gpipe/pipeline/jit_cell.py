"""XLA-compiled pipeline cells (`PipeliningLayer.Params().jit_compile`).

Each cell's forward pass on one micro-batch runs as one XLA computation
(`tf.function(jit_compile=True)`) on the cell's device, and so does its
re-materialization together with its backward pass:

  forward:   y = F_k(theta_k, x, seed)              one XLA cluster
  backward:  dtheta, dx = G_k(theta_k, x, seed, dy)  one XLA cluster: the
             recomputed forward and the gradient, fused by XLA
  (a cell whose forward kept its tape, recompute='never' and the like:
   F_k's XLA-compiled gradient, from the activations F_k saved)

On CPU and GPU this removes the per-op overhead (one kernel launch, one
executor step per op) that makes small micro-batches slow, and lets XLA fuse
element-wise ops. The functions take the cell's weights, inputs and step
seed as flat tensors; the eval mode and the batch-norm statistics (returned
as outputs and handed to the enclosing `UpdateCollector`) cross the
function boundary explicitly, so a compiled cell computes exactly what the
plain one does.

A layer with an op XLA cannot compile is found when the cell is first
traced (its graph is converted to HLO, without compiling) and reported as a
ValueError naming the pipeline, the cell, the layer and the op, with the
fix: set jit_compile=False.
"""

import re

from absl import logging
import tensorflow as tf

from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.pipeline import graph_ops

__all__ = ['JitCells']


def _IsFloat(t):
  return py_utils.IsTensor(t) and t.dtype.is_floating


def _Spec(t):
  return tf.TensorSpec(t.shape, t.dtype)


def _Anchored(flat):
  """The outputs of a compiled call, made safe to be used only as control
  dependencies (`strict_order` chains a device's next work item on them).

  Where the pipeline's outputs are not used (a step that returns only
  gradients), Grappler's dependency optimizer turns a call whose outputs
  feed nothing but control edges into a NoOp, yet keeps its
  `_XlaMustCompile` attribute, and the step then fails with "Function NoOp
  is not defined". A one-element copy of the first output, a stateful op
  that the optimizer keeps, gives the call a data consumer as long as
  anything depends on its outputs.
  """
  if not flat or tf.executing_eagerly() or _tf_internal.InXlaContext():
    return flat
  keep = tf.raw_ops.DeepCopy(x=tf.reshape(flat[0], [-1])[:1])
  _tf_internal.RunIndependently(keep.op)
  return graph_ops.After(list(flat), [keep])


class _Layout:
  """How (theta_k, args, seed) map to a flat list of tensors, and back."""

  def __init__(self, theta_k, args, seed):
    self.structure = (theta_k, tuple(args), seed)
    flat = tf.nest.flatten(self.structure)
    self.tensor_idx = [i for i, t in enumerate(flat) if py_utils.IsTensor(t)]
    self.statics = [None if py_utils.IsTensor(t) else t for t in flat]
    self.tensors = [flat[i] for i in self.tensor_idx]
    self.key = (
      repr(tf.nest.map_structure(lambda _: 0, self.structure)),
      repr([s for s in self.statics if s is not None]),
    )

  def Unpack(self, tensors):
    flat = list(self.statics)
    for i, t in zip(self.tensor_idx, tensors):
      flat[i] = t
    theta_k, args, seed = tf.nest.pack_sequence_as(self.structure, flat)
    return theta_k, args, seed


class JitCells:
  """The XLA-compiled forward and recompute-and-backward of every cell.

  Args:
    cell_fprop: fn(k, theta_k, args tuple, mark) -> outputs tuple of cell k;
      `mark(layer)` is called before each of the cell's layers runs (to tell
      which layer made which op).
    cell_layers: fn(k) -> the layers of cell k.
    name: the pipeline's path, for error messages.
  """

  def __init__(self, cell_fprop, cell_layers, name):
    self._cell_fprop = cell_fprop
    self._cell_layers = cell_layers
    self._name = name
    self._fns = {}  # (kind, k, eval, layout key) -> (tf.function, meta)
    self._checked = set()

  # -- The functions ---------------------------------------------------------

  def _Run(self, k, layout, tensors, is_eval, collector, mark=None):
    theta_k, args, seed = layout.Unpack(tensors)
    with py_utils.EvalMode(is_eval), py_utils.StepSeed(seed), collector:
      return py_utils.AsTuple(self._cell_fprop(k, theta_k, args, mark))

  def _Forward(self, k, layout, is_eval):
    key = ('forward', k, is_eval, layout.key)
    if key not in self._fns:
      meta = {}

      def Forward(*tensors):
        collector = py_utils.UpdateCollector()
        out = self._Run(
          k, layout, tensors, is_eval, collector, meta.get('mark')
        )
        meta['out'] = out
        meta['updates'] = [(lyr, stats) for lyr, stats in collector.updates]
        return tf.nest.flatten(out) + tf.nest.flatten(
          [stats for _, stats in collector.updates]
        )

      self._fns[key] = (tf.function(Forward, jit_compile=True), meta)
    return self._fns[key]

  def _Grad(self, k, layout, is_eval, present):
    """The recompute-and-backward of cell k; `present[i]`: whether the
    gradient of output i is given (the function takes just those)."""
    key = ('grad', k, is_eval, layout.key, present)
    if key not in self._fns:
      meta = {}

      def Grad(*tensors):
        n = len(layout.tensors)
        inputs, given = tensors[:n], list(tensors[n:])
        sources = [t for t in inputs if _IsFloat(t)]
        # (The XLA check traces this inside tf.init_scope, which stops tapes.)
        with (
          _tf_internal.RecordingOn(),
          tf.GradientTape(watch_accessed_variables=False) as tape,
        ):
          tape.watch(sources)
          out = self._Run(
            k, layout, inputs, is_eval, py_utils.UpdateCollector()
          )
        pairs = [
          (y, given.pop(0)) for y, p in zip(tf.nest.flatten(out), present) if p
        ]
        grads = tape.gradient(
          [y for y, _ in pairs],
          sources,
          output_gradients=[dy for _, dy in pairs],
        )
        meta['present'] = [g is not None for g in grads]
        return [g for g in grads if g is not None]

      self._fns[key] = (tf.function(Grad, jit_compile=True), meta)
    return self._fns[key]

  # -- The check ---------------------------------------------------------------

  def _Check(self, k, fn, meta, tensors, key):
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

    specs = [_Spec(t) for t in tensors]
    meta['mark'] = Mark
    try:
      with tf.init_scope():
        fn.experimental_get_compiler_ir(*specs)(stage='hlo')
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
      meta.pop('mark', None)

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

  # -- What the pipeline calls -------------------------------------------------

  def FProp(self, k, theta_k, args):
    """Cell k on one micro-batch, as one XLA computation."""
    layout = _Layout(theta_k, args, py_utils.CurrentStepSeed())
    is_eval = py_utils.IsEval()
    fn, meta = self._Forward(k, layout, is_eval)
    self._Check(k, fn, meta, layout.tensors, ('forward', k, is_eval))
    flat = _Anchored(fn(*layout.tensors))
    out_flat = tf.nest.flatten(meta['out'])
    out = tf.nest.pack_sequence_as(meta['out'], flat[: len(out_flat)])
    rest = flat[len(out_flat) :]
    for layer, stats in meta['updates']:
      n = len(tf.nest.flatten(stats))
      py_utils.AddDeferredUpdate(
        layer, tf.nest.pack_sequence_as(stats, rest[:n])
      )
      rest = rest[n:]
    return out

  def RecomputeBackward(self, k, theta_k, args, dys):
    """Re-materializes cell k on one micro-batch and back-propagates `dys`
    (the gradients of its outputs, None where there is none) in one XLA
    computation. Returns (gradients of theta_k, of args), structured like
    them, None where there is none.

    Nothing of the forward computation is kept or re-run outside the
    compiled call: the forward values live only inside it.
    """
    layout = _Layout(theta_k, args, py_utils.CurrentStepSeed())
    is_eval = py_utils.IsEval()
    flat_dys = tf.nest.flatten(dys)
    present = tuple(dy is not None and _IsFloat(dy) for dy in flat_dys)
    if not any(present):
      return tf.nest.map_structure(lambda _: None, (theta_k, tuple(args)))
    grad, grad_meta = self._Grad(k, layout, is_eval, present)
    given = [dy for dy, p in zip(flat_dys, present) if p]
    self._Check(
      k, grad, grad_meta, layout.tensors + given, ('grad', k, is_eval, present)
    )
    got = list(grad(*layout.tensors, *given))
    flat = [got.pop(0) if p else None for p in grad_meta['present']]
    # Float inputs in order, then back to (theta_k, args, seed).
    tensors = [None] * len(layout.tensors)
    float_pos = [i for i, t in enumerate(layout.tensors) if _IsFloat(t)]
    for i, g in zip(float_pos, flat):
      tensors[i] = g
    theta_grads, arg_grads, _ = layout.Unpack(tensors)
    return theta_grads, arg_grads
