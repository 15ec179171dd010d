"""XLA-compiled functions compiled on their devices ahead of their first call.

A function traced with `jit_compile=True` compiles on its device when its
call first runs. In a pipeline the first step's calls run one device after
another, so its compiles do too. `Precompiler.Start`, called while the step
is traced, compiles each (function, device) in a background thread at once.
"""

import concurrent.futures
import os

from absl import logging
import tensorflow as tf

from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import py_utils

__all__ = ['Precompiler']


class Precompiler:
  """Compiles XLA-compiled functions on the devices that call them while
  the step that calls them is still being traced.

  A compiled function compiles on its device when its call first runs, and
  the first step's calls run in the pipeline's order: device k's first
  forward waits for device k-1's, so the step's 2K compiles run one after
  another, after the trace and the step's instantiation. Here, as soon as
  the trace first calls a function on a device, a background thread runs it
  there once on zeros of the call's shapes (a function of its own that
  nothing else waits for): the devices compile at once while the trace goes
  on, and XLA's cache on each device then serves the step's call (the same
  function and shapes) or holds it until that compile ends. Only the
  compile is shared: the step computes its own values.

  Functions with a stateful op other than reading a variable are left to
  compile in the step: running them once more could draw from a random
  generator or write a variable.

  The pipeline's cells use it (`cells/cell_function.py`, Params
  `precompile`); it takes any function traced with jit_compile=True. The
  compiles run from one pool of threads for the process, `NumThreads()` at
  a time.

  Args:
    name: who compiles (a pipeline's path), for messages.
    remote_only: only devices of other processes (worker tasks): there each
      host compiles its own cells; in this process the compiles would share
      this host's cores with the trace.
  """

  _pool = None
  _READS = frozenset({'ReadVariableOp', 'VarHandleOp', 'VarIsInitializedOp'})

  def __init__(self, name, remote_only):
    self._name = name
    self._remote_only = remote_only
    self._started = {}  # {(function name, device): future}
    self._stateful = {}  # {function name: whether an op is stateful}
    self._here = None

  def Start(self, concrete, tensors, device):
    """Compiles `concrete` on `device` for `tensors`' shapes, once."""
    key = (concrete.name, device)
    if key in self._started:
      return
    self._started[key] = None
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in tensors]
    if (
      (self._remote_only and not self._Remote(device))
      or not all(_Fillable(s) for s in specs)
      or self._Stateful(concrete)
    ):
      return
    try:
      with tf.init_scope():
        if not tf.executing_eagerly():
          return
        warm = _Warm(concrete, specs, device)
        zero = tf.constant(0)
    except Exception as e:  # pylint: disable=broad-except
      self._Failed(device, e)
      return
    if Precompiler._pool is None:
      Precompiler._pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=NumThreads(), thread_name_prefix='xla_precompile'
      )
    self._started[key] = Precompiler._pool.submit(self._Run, warm, zero, device)

  def Wait(self):
    """[(function name, device)] of the compiles started, once all ended."""
    done = [key for key, f in self._started.items() if f is not None]
    concurrent.futures.wait([self._started[key] for key in done])
    return done

  def _Stateful(self, concrete):
    """Whether `concrete` holds a stateful op other than a read."""
    if concrete.name not in self._stateful:
      self._stateful[concrete.name] = any(
        n.op not in self._READS and _tf_internal.IsStateful(n.op)
        for n in py_utils.NodeDefs(concrete.graph)
      )
    return self._stateful[concrete.name]

  def _Remote(self, device):
    """Whether `device` is in another process than this one."""
    if self._here is None:
      # Outside the caller's device scope, which init_scope keeps: inside a
      # cell's, this process would look like the cell's.
      with tf.init_scope(), tf.device(None):
        self._here = tf.DeviceSpec.from_string(tf.constant(0).device)
    spec = tf.DeviceSpec.from_string(device)
    return spec.job is not None and (spec.job, spec.task or 0) != (
      self._here.job,
      self._here.task or 0,
    )

  def _Run(self, warm, zero, device):
    try:
      with _tf_internal.WithoutGraphOptimizer():
        warm(zero)
    except Exception as e:  # pylint: disable=broad-except
      self._Failed(device, e)

  def _Failed(self, device, error):
    # The function's own first call then compiles it, and reports what
    # fails.
    logging.info(
      '%s: compiling a function on %s ahead of its first call failed (%s); '
      'its first call compiles it.',
      self._name,
      device,
      str(error).split('\n')[0],
    )


def NumThreads(num_cores=None):
  """How many compiles run at once: one core of this host is left to the
  trace, which runs in one thread, and at most 4.

  A compile costs this host a thread of the driver while the step is traced
  (the call that compiles it is instantiated here), and where the devices
  are worker processes on this host, the worker's compile too. With more
  compiles at once than the cores can run beside the trace, the trace slows
  down more than the compiles gain (`docs/benchmarks.md`).

  Args:
    num_cores: this host's cores (default: `os.cpu_count()`).
  """
  num_cores = num_cores or os.cpu_count() or 1
  return max(1, min(4, num_cores - 1))


def _Warm(concrete, specs, device):
  """A function that calls `concrete` on `device`, on zeros of `specs` made
  there from its one argument (a scalar int32 zero).

  Only the runtime's function is kept, not the graph it was traced from:
  that graph holds a copy of the function it calls, and the warm-ups of a
  step, all made while the step is traced and waiting for their turn,
  took the driver of a 192-layer LM with XLA-compiled cells 240 MB more.

  One zero tensor per distinct shape and dtype: a cell's weights come in a
  few shapes (identical layers), and one fill per argument made 6,214 ops,
  6.8 s of the trace of that LM's 16 warm-ups.
  """

  def Warm(zero):
    # Zeros made on the device from an argument: constants would be
    # folded into a function of their own.
    zeros = {}  # {(shape, dtype): a zero tensor}
    with tf.device(device):
      for s in specs:
        key = (tuple(s.shape), s.dtype)
        if key not in zeros:
          zeros[key] = tf.fill(s.shape, tf.cast(zero, s.dtype))
      args = [zeros[(tuple(s.shape), s.dtype)] for s in specs]
      # Called as the step calls it: without shape inference of its body.
      flat = _tf_internal.CallFunction(concrete, args)
      # One element of an output, so that the call is not pruned.
      return tf.reshape(flat[0], [-1])[:1]

  return _tf_internal.WithoutGraph(
    tf.function(Warm, autograph=False).get_concrete_function(
      tf.TensorSpec([], tf.int32)
    )
  )


def _Fillable(spec):
  """Whether zeros of `spec` can be made on a device (a known shape, a
  number or bool dtype)."""
  return spec.shape.is_fully_defined() and (
    spec.dtype.is_floating
    or spec.dtype.is_integer
    or spec.dtype.is_complex
    or spec.dtype == tf.bool
  )
