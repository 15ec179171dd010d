"""Every TensorFlow internal the library relies on, in one place.

Each name here is outside TensorFlow's public API; each comes with why it is
needed, and `tests/core/tf_internal_test.py` fails with a clear message if a
TensorFlow upgrade removes or changes it. Nothing else in the library
imports `tensorflow.python`.
"""

import contextlib
import functools

import tensorflow as tf

# The gradient-tape recording API that tf.custom_gradient is built on. The
# pipeline records its whole forward schedule as one tape operation; through
# tf.custom_gradient every tensor would pass one device-less IdentityN op,
# dragging a multi-host pipeline's activations through one host.
from tensorflow.python.eager import record as _record

# Per-op statistics ('flops') that TensorFlow registers for its kernels; the
# public profiler only reports them for a whole graph, not per op.
from tensorflow.python.framework import ops as _ops

# Whether the graph being built is compiled by XLA (tf.function(jit_compile=
# True) enters an XLA context): the pipeline's scheduling op DeepCopy has
# no XLA kernel, and XLA orders the computation itself.
from tensorflow.python.ops import control_flow_util as _control_flow_util

# A function call op built directly (`CallFunction`): the call options and
# the read-only-resource and collective attributes that TensorFlow's own call
# sets, and the attribute that skips shape inference of the called body.
from tensorflow.core.framework import attr_value_pb2 as _attr_value_pb2
from tensorflow.python.eager import context as _context
from tensorflow.python.eager.polymorphic_function import (
  atomic_function as _atomic_function,
)
from tensorflow.python.framework import auto_control_deps_utils as _acd

# The graphs that tf.cond and tf.while_loop trace their branches and bodies
# into: a pipeline built as a loop calls, from inside them, the cell
# functions of the step the loop is part of.
from tensorflow.python.ops import (
  control_flow_v2_func_graphs as _cf_graphs,
)

# The kernels registered for each op, XLA's among them (device types
# XLA_CPU_JIT, XLA_GPU_JIT): an XLA-compiled cell is checked op by op against
# them when it is first traced, without converting it to HLO.
from tensorflow.python.framework import kernels as _kernels

# Each op's definition (whether it is stateful): a compiled cell is run
# ahead of the step, to compile it, only where none of its ops is.
from tensorflow.python.framework import op_def_registry as _op_def_registry

# The one function that makes a Const op in a graph (tf.constant, a Python
# number converted to a tensor): `SharedConstants` wraps it, so that a
# cell's function holds each distinct constant once.
from tensorflow.python.framework import tensor_util as _tensor_util
from tensorflow.python.framework import op_callbacks as _op_callbacks

# Silences the deprecation notice that TensorFlow's own flop statistics
# print (they call a TF1 shape helper) every time a new graph is counted.
from tensorflow.python.util import deprecation as _deprecation

__all__ = [
  'CouldPossiblyRecord',
  'ShouldRecordBackprop',
  'VariableWatcher',
  'RecordOperation',
  'OpFlops',
  'RunIndependently',
  'TPUDeviceAssignment',
  'TPUDevices',
  'InXlaContext',
  'RecordingOn',
  'CallFunction',
  'OutermostOfControlFlow',
  'StopRecording',
  'XlaKernelConstraints',
  'IsStateful',
  'WithoutGraphOptimizer',
  'AddControlInputs',
  'RemoveControlInputs',
  'ReleaseDefinitionCopies',
  'ReleaseControlFlowGraphs',
  'WithoutGraph',
  'SharedConstants',
  'WithSharedConstants',
]

# Device types whose XLA kernels are registered in this process.
_xla_registered = set()


def CouldPossiblyRecord():
  """Whether a gradient tape could record an op built now."""
  return _record.could_possibly_record()


def ShouldRecordBackprop(tensors):
  """Whether an active gradient tape watches any of `tensors` (the
  pipeline skips the gradient of inputs that no tape asks for)."""
  return bool(tensors) and _record.should_record_backprop(tensors)


def VariableWatcher():
  """A context that lists the variables read inside it
  (`.watched_variables()`); the pipeline uses it to reject layers that read
  variables directly instead of through theta."""
  return _record.VariableWatcher()


@contextlib.contextmanager
def RecordingOn():
  """Gradient tapes record inside, even where `tf.init_scope` stopped them:
  the XLA check of a compiled pipeline cell traces its backward function
  (which computes gradients with a tape) from inside `tf.init_scope`."""
  stopped = _record.pywrap_tfe.TFE_Py_TapeSetIsStopped()
  if stopped:
    _record.pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
  try:
    yield
  finally:
    if stopped:
      _record.pywrap_tfe.TFE_Py_TapeSetStopOnThread()


def StopRecording():
  """A context in which no gradient tape records (`tf.GradientTape.
  stop_recording` without the tape object: the pipeline does not hold the
  caller's tapes)."""
  return _record.stop_recording()


def RecordOperation(op_type, outputs, inputs, backward_fn):
  """Records `outputs` = op(`inputs`) on the active tapes, with gradient
  function backward_fn(*output_grads) -> input grads."""
  _record.record_operation(op_type, outputs, inputs, backward_fn)


def OpFlops(graph, node_def):
  """TensorFlow's registered 'flops' statistic of one op (None if unset).

  Raises ValueError or TypeError where the op has no statistic function or
  its shapes are unknown.
  """
  with _deprecation.silence():
    return _ops.get_stats_for_node_def(graph, node_def, 'flops').value


def RunIndependently(op):
  """Exempts a stateful op from tf.function's program-order chaining.

  tf.function makes every stateful op depend on the one built before it
  (automatic control dependencies); the pipeline's fresh copies must instead
  run when their own inputs are ready. The graph's
  `experimental_acd_manager` is the only way to opt one op out.
  """
  acd = getattr(
    tf.compat.v1.get_default_graph(), 'experimental_acd_manager', None
  )
  if acd is not None and not tf.executing_eagerly():
    acd.run_independently(op)


def AddControlInputs(op, control_ops):
  """Makes an op already built wait for `control_ops` (graph mode): the
  pipeline orders the ops of a gradient that `tf.GradientTape` built."""
  op._add_control_inputs(control_ops)  # pylint: disable=protected-access


def RemoveControlInputs(op, control_ops):
  """Undoes `AddControlInputs(op, control_ops)`."""
  drop = {c.name for c in control_ops}
  keep = [c for c in op.control_inputs if c.name not in drop]
  op._remove_all_control_inputs()  # pylint: disable=protected-access
  if keep:
    op._add_control_inputs(keep)  # pylint: disable=protected-access


def TPUDeviceAssignment(extended):
  """A TPUStrategy's device assignment (`extended._device_assignment`), or
  None: TPUStrategy has no public count of cores per replica."""
  return getattr(extended, '_device_assignment', None)


def TPUDevices(extended):
  """A TPUStrategy's [replicas, cores] TPU devices (`extended._tpu_devices`),
  which `experimental_assign_to_logical_device` checks core ids against
  (tensorflow/python/distribute/tpu_strategy.py); None if absent."""
  return getattr(extended, '_tpu_devices', None)


def InXlaContext():
  """Whether ops built now are compiled by XLA (tf.function(jit_compile=True)
  or an XLA-compiled TPU computation)."""
  return _control_flow_util.GraphOrParentsInXlaContext(
    tf.compat.v1.get_default_graph()
  )


def CallFunction(concrete, args, return_op=False):
  """The outputs (a list) of one call of the concrete function `concrete`
  on the tensors `args`, built into the current graph like
  `concrete(*args)`, but without shape inference of the called body
  (with `return_op`, the call op itself, e.g. for a function of updates
  without outputs).

  Building a call op infers the shapes of every op of the called function
  again (about 18 us per op of the body per call: 15 ms per call of a
  1,000-op cell, for each of a step's hundreds of work items). The outputs'
  shapes are the function's own, so the call op is built directly with
  TensorFlow's `_disable_call_shape_inference` attribute, and its outputs
  get the function's output shapes. Not for a call a gradient tape
  records (the tape needs TensorFlow's own call).
  """
  atomic = concrete._inference_function  # pylint: disable=protected-access
  args = list(args) + list(concrete.captured_inputs)
  graph = tf.compat.v1.get_default_graph()
  graph._add_function_recursive(atomic)  # pylint: disable=protected-access
  a = _attr_value_pb2.AttrValue
  outs = atomic.function_type.flat_outputs
  tout = [o.dtype.as_datatype_enum for o in outs]
  options = _context.context().function_call_options.as_attrs()
  attrs = {
    'Tin': a(list=a.ListValue(type=[t.dtype.as_datatype_enum for t in args])),
    'Tout': a(list=a.ListValue(type=tout)),
    'f': a(func=_attr_value_pb2.NameAttrList(name=atomic.name)),
    'config_proto': a(s=options['config_proto']),
    'executor_type': a(s=(options['executor_type'] or '').encode()),
    '_disable_call_shape_inference': a(b=True),
  }
  xla = _XlaMustCompile(atomic)
  if xla is not None:
    attrs['_XlaMustCompile'] = xla
  stateful = atomic.call_options.is_stateful
  op = graph.create_op(
    'StatefulPartitionedCall' if stateful else 'PartitionedCall',
    args,
    [o.dtype for o in outs],
    name='call',
    attrs=attrs,
  )
  _atomic_function._set_read_only_resource_inputs_attr(op, atomic.graph)  # pylint: disable=protected-access
  _ops.set_int_list_attr(
    op,
    _acd.COLLECTIVE_MANAGER_IDS,
    atomic._call_options.collective_manager_ids_used,  # pylint: disable=protected-access
  )
  result = list(op.outputs)
  for t, o in zip(result, outs):
    t.set_shape(o.shape)
  return op if return_op else result


_xla_must_compile = {}  # {function name: its _XlaMustCompile attr or None}


def _XlaMustCompile(atomic):
  """The `_XlaMustCompile` attribute of the function `atomic`, or None;
  read once per function, from a copy of its definition that is dropped
  (TensorFlow's `cached_definition` keeps a Python copy of the whole
  definition, megabytes for a deep compiled cell)."""
  if atomic.name not in _xla_must_compile:
    attr = atomic.definition.attr.get('_XlaMustCompile', None)
    _xla_must_compile[atomic.name] = None if attr is None else _Own(attr)
  return _xla_must_compile[atomic.name]


def _Own(attr):
  """A copy of the AttrValue `attr` that shares no memory with the
  message it came from (a field of a Python proto keeps its whole message
  alive)."""
  return _attr_value_pb2.AttrValue.FromString(attr.SerializeToString())


def ReleaseDefinitionCopies(concrete):
  """Drops the Python copies of `concrete`'s FunctionDef that TensorFlow
  keeps for it.

  A traced concrete function and its gradient helper each keep the
  function's attributes as fields of a Python copy of its whole definition
  (and the field keeps the copy alive): two copies of every op of the body.
  For a 192-layer LM with XLA-compiled cells that is over 100 MB of the
  driver. The attributes are kept as copies of their own; the definition
  itself stays in the runtime, where calls find it.
  """
  concrete._attrs = {k: _Own(v) for k, v in concrete._attrs.items()}  # pylint: disable=protected-access
  rewrite = getattr(concrete, '_delayed_rewrite_functions', None)
  if rewrite is not None:
    rewrite._attrs = {k: _Own(v) for k, v in rewrite._attrs.items()}  # pylint: disable=protected-access
  concrete._inference_function._cached_definition = None  # pylint: disable=protected-access


def WithoutGraph(concrete):
  """A callable that runs the concrete function `concrete` eagerly on flat
  tensors and returns its flat outputs, holding the function as the
  runtime has it but not the graph it was traced from (which TensorFlow
  frees with `concrete`)."""
  atomic = concrete._inference_function  # pylint: disable=protected-access
  atomic._cached_graph = None  # pylint: disable=protected-access
  captured = list(concrete.captured_inputs)
  return lambda *args: atomic.call_flat(*args, *captured)


_BODY_GRAPHS = ('_body_graph', '_cond_graph', '_true_graph', '_false_graph')
_BODY_FUNCTIONS = ('body', 'cond', 'then_branch', 'else_branch')


_CONTROL_FLOW_OPS = frozenset(('While', 'StatelessWhile', 'If', 'StatelessIf'))


def ReleaseControlFlowGraphs(ops):
  """Drops the Python graphs that the tf.while_loop and tf.cond ops among
  `ops` (and those nested in their bodies and branches) were traced from;
  other ops are passed over.

  TensorFlow keeps each body's and branch's FuncGraph, for a gradient tape
  that might differentiate the op later, and each keeps its own copy of
  every function it calls: a loop over the pipeline's ticks held a copy of
  each cell's functions per cell's branch. Where no tape records the ops,
  nothing needs those graphs again; were one asked for, TensorFlow builds
  it anew from the function's definition in the runtime.
  """
  for op in ops:
    if op.type not in _CONTROL_FLOW_OPS:
      continue
    for a in _BODY_GRAPHS:
      body = getattr(op, a, None)
      if body is not None:
        ReleaseControlFlowGraphs(body.get_operations())
        setattr(op, a, None)
    names = set()
    for a in _BODY_FUNCTIONS:
      try:
        names.add(op.get_attr(a).name)
      except ValueError:
        pass
    graph = op.graph
    while graph is not None:
      for name in names:
        atomic = graph._functions.get(name)  # pylint: disable=protected-access
        if atomic is not None:
          atomic._cached_graph = None  # pylint: disable=protected-access
      graph = getattr(graph, 'outer_graph', None)


_CONTROL_FLOW_GRAPHS = (
  _cf_graphs.CondBranchFuncGraph,
  _cf_graphs.WhileBodyFuncGraph,
  _cf_graphs.WhileCondFuncGraph,
)


def OutermostOfControlFlow(graph):
  """The graph that `graph` belongs to once its tf.cond branches and
  tf.while_loop bodies are left: itself unless it is one of those."""
  while isinstance(graph, _CONTROL_FLOW_GRAPHS):
    graph = graph.outer_graph
  return graph


def XlaKernelConstraints(op_type, device_type):
  """[{type attribute: allowed dtypes}], one per XLA kernel of `op_type` for
  devices of `device_type` ('CPU', 'GPU'); [] where XLA has none. None
  where XLA's kernels for that device type are not known here (no such
  device in this process).

  TensorFlow registers XLA's kernels the first time it compiles for a
  device type: a trivial function converted to HLO does that."""
  jit = f'XLA_{device_type}_JIT'
  if device_type not in _xla_registered:
    try:
      with tf.init_scope():
        f = tf.function(
          lambda: tf.constant(0.0), jit_compile=True, autograph=False
        )
        f.experimental_get_compiler_ir()(stage='hlo', platform_name=device_type)
    except Exception:  # pylint: disable=broad-except
      return None
    _xla_registered.add(device_type)
  return [
    {
      c.name: {tf.as_dtype(t) for t in c.allowed_values.list.type}
      for c in k.constraint
      if c.allowed_values.list.type
    }
    for k in _kernels.get_registered_kernels_for_op(op_type).kernel
    if k.device_type == jit
  ]


def IsStateful(op_type):
  """Whether ops of type `op_type` are stateful (None: not a registered op,
  e.g. a call of a library function)."""
  op_def = _op_def_registry.get(op_type)
  return None if op_def is None else op_def.is_stateful


@contextlib.contextmanager
def WithoutGraphOptimizer():
  """Function calls from this thread, in this scope, skip Grappler when
  instantiated.

  Sets the thread's function-call options (per thread in the eager
  context) and restores them after: calls run ahead of the step only to
  compile a cell, and the step's own instantiation optimizes what it
  runs."""
  ctx = _context.context()
  before = ctx.function_call_options
  config = ctx.config
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  ctx.function_call_options = _context.FunctionCallOptions(config_proto=config)
  try:
    yield
  finally:
    ctx.function_call_options = before


# The attribute of a graph that holds its shared constants while
# `SharedConstants` is active in it: {(TensorProto bytes, devices): tensor}.
_SHARED_CONSTANTS = '_lingvo_gpipe_shared_constants'
_make_graph_constant = _ops._create_graph_constant  # pylint: disable=protected-access


def _SharedConstantKey(graph, proto):
  """The key of a constant that may be shared in `graph` now, else None.

  A constant made under control dependencies, a v1 control-flow context
  (an XLA-compiled function's own context is none), colocation, attribute
  scopes, op callbacks or a device function is made anew, as TensorFlow
  makes it; otherwise its value, dtype, shape and the device scopes
  decide.
  """
  # pylint: disable=protected-access
  flow = graph._get_control_flow_context()
  if (
    graph._control_dependencies_stack
    or (flow is not None and not flow.IsXLAContext())
    or graph._colocation_stack
    or graph._attr_scope_map
    or _op_callbacks.should_invoke_op_callbacks()
  ):
    return None
  devices = []
  for spec in graph._device_function_stack.peek_objs():
    if callable(spec._device_name_or_function):
      return None
    devices.append(str(spec._device_name_or_function))
  # pylint: enable=protected-access
  return proto.SerializeToString(deterministic=True), tuple(devices)


def _GraphConstant(value, dtype, shape, name, verify_shape, allow_broadcast):
  """TensorFlow's graph constant, shared in graphs under `SharedConstants`."""
  graph = _ops.get_default_graph()
  shared = getattr(graph, _SHARED_CONSTANTS, None)
  if shared is None:
    return _make_graph_constant(
      value, dtype, shape, name, verify_shape, allow_broadcast
    )
  proto = _tensor_util.make_tensor_proto(
    value,
    dtype=dtype,
    shape=shape,
    verify_shape=verify_shape,
    allow_broadcast=allow_broadcast,
  )
  key = _SharedConstantKey(graph, proto)
  if key is not None and key in shared:
    return shared[key]
  # A TensorProto passes through make_tensor_proto unchanged.
  tensor = _make_graph_constant(
    proto, None, None, name, verify_shape, allow_broadcast
  )
  if key is not None:
    shared[key] = tensor
  return tensor


_ops._create_graph_constant = _GraphConstant  # pylint: disable=protected-access


@contextlib.contextmanager
def SharedConstants():
  """In this scope, equal constants of the current graph are one Const op.

  TensorFlow makes a Const op for every constant, and its gradient code
  makes many that are equal (reduction axes, shapes, ones): a cell's
  function of a few thousand ops held a third of them as constants, about a
  hundred of them distinct. Each such op costs its function's size where
  the function is traced, held, shipped to a worker and optimized, and at
  each call op where TensorFlow builds the called body again. Sharing one
  op per value gives the same values, so the same results. It applies to
  the graph current on entry (a cell's function being traced), not to
  graphs traced inside it.
  """
  graph = _ops.get_default_graph()
  if getattr(graph, _SHARED_CONSTANTS, None) is not None:
    yield
    return
  setattr(graph, _SHARED_CONSTANTS, {})
  try:
    yield
  finally:
    delattr(graph, _SHARED_CONSTANTS)


def WithSharedConstants(fn):
  """`fn` (a function's body) traced under `SharedConstants`."""

  @functools.wraps(fn)
  def Traced(*args, **kwargs):
    with SharedConstants():
      return fn(*args, **kwargs)

  return Traced
