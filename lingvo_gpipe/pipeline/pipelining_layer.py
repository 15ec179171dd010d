"""PipeliningLayer: GPipe pipeline parallelism (Huang et al., 2019).

A sequence of layers is split into K cells, cell k placed on device k. A
mini-batch is split into M micro-batches that flow through the cells in the
fill-drain schedule (see `schedule.py` for the clock-cycle table):

    forward:  for clock c in 0 .. M+K-2: cell k runs micro-batch c - k
    backward: the mirror image, starting from the last cell's last micro-batch
    update:   gradients of all micro-batches are summed, then applied once

This module holds the layer (Params, construction, introspection);
`engine.py` builds the schedule. The whole pipeline is one differentiable op
(recorded on the gradient tape like `tf.custom_gradient`) whose backward
pass is built explicitly, cell by cell and micro-batch by micro-batch, on
each cell's device (`engine.PipelineEngine` runs any schedule of such work
items; this is `schedule.FillDrain`):

    def Forward(inputs, theta):                 # inside one tf.function
      xs = split(inputs, M)                     # on device 0
      for (c, k, m) in ForwardOrder(K, M):      # device k
        with StepSeed(seed(step, m)):           # random ops are addressable
          xs[m] = cell[k](theta[k], xs[m])      # keeps only xs[m] if recompute
      return concat(xs)                         # on device K-1

    def Backward(dys):
      for (c, k, m) in BackwardOrder(K, M):     # device k
        if recompute: redo cell[k](theta[k], x[k][m]) with the same seed
        dx[m], dtheta_m = vjp(cell[k], dys[m])
        dtheta[k] += dtheta_m                   # accumulated on device k
        dys[m] = dx[m]
      return concat(dys), dtheta

TensorFlow runs each device's ops as soon as their inputs are ready, so cell
k works on micro-batch m while cell k+1 works on m-1; with `strict_order`
each device also runs its micro-batches in schedule order. The result is
exactly the sequential model's: the same outputs and, up to float rounding of
the sum over micro-batches, the same gradients for every K and M.

Data parallelism: with `num_replicas` R, R copies of the pipeline run on R*K
devices, replica r on micro-batches r*M .. r*M+M-1 of the mini-batch; the
variables live on replica 0's devices, each other replica reads them once
per step, and each cell's gradients are summed over the replicas on the
device of its variables: the result of one pipeline of R*M micro-batches.
Inside a TPUStrategy replica of several cores, cell k runs on logical core k
instead (see `lingvo_gpipe.core.tpu`).

Two ways to describe the cells:
  * Lingvo's: `cell_tpl`, a list of K cell Params (e.g. FeatureExtractionLayer).
  * A flat list of layer Params in `layers`, split by the library into
    `num_stages` balanced cells (or at explicit `splits`). The layers are
    children of the pipeline itself, so variable names do not depend on the
    split: a checkpoint of K=8 restores into K=1.
"""

import contextlib
import functools

import tensorflow as tf

from lingvo_gpipe.cells import cell_function
from lingvo_gpipe.cells import cell_shapes
from lingvo_gpipe.cells import layer_function
from lingvo_gpipe.core import _tf_internal
from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.layers import sequential
from lingvo_gpipe.pipeline import engine
from lingvo_gpipe.pipeline import microbatch
from lingvo_gpipe.pipeline import placement
from lingvo_gpipe.pipeline import schedule
from lingvo_gpipe.planning import auto

__all__ = [
  'FeatureExtractionLayer',
  'PipeliningLayer',
  'RECOMPUTE_POLICIES',
  'SCHEDULES',
]

RECOMPUTE_POLICIES = engine.RECOMPUTE_POLICIES
SCHEDULES = schedule.SCHEDULES


FeatureExtractionLayer = sequential.FeatureExtractionLayer


class PipeliningLayer(base_layer.BaseLayer):
  """Pipelines cells over devices with micro-batches. See module docstring."""

  # fn(num_cells, num_micro_batches) -> [schedule.WorkItem] the engine runs;
  # a subclass that sets it overrides Params().schedule.
  _schedule = staticmethod(schedule.FillDrain)

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define(
      'before_tpl',
      [],
      "Lingvo's SeqLayer: layers run in order before the pipeline, on the "
      "first cell's device, on the whole mini-batch; children named by "
      'their Params names.',
    )
    p.Define(
      'cell_tpl',
      [],
      'List of cell Params, one per stage (Lingvo); each cell is a child '
      'named by its Params name (default cell_<k>): theta.cell_0.',
    )
    p.Define(
      'layers',
      [],
      'Flat list of layer Params, split into num_stages cells by the '
      'library (alternative to cell_tpl).',
    )
    p.Define(
      'num_stages',
      None,
      'Number of cells K for `layers`; None: len(devices) or 1; '
      "'auto': the planner (planning/planner.py) chooses K for the "
      'devices at hand (needs input_shapes with the batch size).',
    )
    p.Define(
      'splits',
      None,
      'Explicit cell end indices for `layers`, e.g. [3, 8] for layers '
      '[0,3) and [3,8); an int means num_stages.',
    )
    p.Define(
      'balance_by',
      'auto',
      'How `layers` are balanced: flops | params | time | uniform | '
      'memory | auto (flops if input_shapes is set, else params). '
      "memory minimizes the largest device's estimated bytes (weights x "
      "memory_state_copies, one micro-batch's activations, the stored "
      'cell inputs); it needs input_shapes of the whole mini-batch.',
    )
    p.Define(
      'memory_state_copies',
      4,
      "balance_by='memory': bytes held per weight byte (weight, gradient, "
      'optimizer slots; Adam: 4, SGD: 2).',
    )
    p.Define(
      'input_shapes',
      None,
      'Shapes of the inputs (list, one per FProp argument; NestedMaps '
      'allowed), e.g. [[batch, 1024]], or tf.TensorSpecs where the dtype '
      'is not float32 (token ids). Enables build-time shape checks '
      'and balancing by flops, time or memory.',
    )
    p.Define(
      'num_micro_batches',
      1,
      "Number of micro-batches M; 'auto': the planner chooses M (a "
      'divisor of the per-replica batch; needs input_shapes).',
    )
    p.Define(
      'planner_device',
      None,
      "With 'auto': the device preset the planner predicts for "
      '(planning/device_presets.PRESETS: tpu_v2, tpu_v3, v100, a100, h100, '
      'cpu); None: guessed from the devices.',
    )
    p.Define(
      'planner_memory_per_device',
      None,
      "With 'auto': bytes of memory per device; None: the preset's.",
    )
    p.Define(
      'micro_batch_size',
      None,
      'Examples per micro-batch; when set, M = batch / this.',
    )
    p.Define('batch_dim', 0, 'The batch axis of inputs and outputs.')
    p.Define(
      'devices',
      None,
      'Device of each cell, e.g. ["/device:CPU:0", "/device:CPU:1"]; '
      'None: the accelerators (or CPU devices) TensorFlow lists. With '
      "num_replicas R, R*K devices, replica-major: replica r's cells "
      'on devices[r*K:(r+1)*K].',
    )
    p.Define(
      'num_replicas',
      1,
      'Data-parallel copies R of the pipeline. Each replica runs 1/R of '
      'the mini-batch (in num_micro_batches micro-batches) on its own '
      "K devices; the variables live once, on replica 0's devices, "
      "and the replicas' gradients are summed there: the same update "
      'as one pipeline with R*M micro-batches.',
    )
    p.Define(
      'recompute',
      'always',
      'Re-materialization: always | except_last_cell | '
      'except_last_micro_batch | never. Recomputed cells keep only '
      'their input activations in the forward pass.',
    )
    p.Define(
      'schedule',
      'gpipe',
      "The pipeline schedule: 'gpipe' (fill-drain: every forward, then "
      "every backward), '1f1b' (one forward, one backward: at most about "
      'K micro-batches in flight per cell; needs the loss on the last '
      "cell, see FPropWithLoss) or 'interleaved' (cell k on device k mod "
      'D of D distinct devices, K a multiple of D: a smaller bubble). '
      'See docs/gpipe.md.',
    )
    p.Define(
      'strict_order',
      True,
      "Run each device's micro-batches in schedule order (control "
      'dependencies), so an accelerator that runs one op at a time '
      'feeds the next cell as early as possible.',
    )
    p.Define(
      'micro_batch_loop',
      False,
      "With schedule='gpipe' and recompute='always', build the step as two "
      "loops over the clock ticks, each calling every cell once (Lingvo's "
      'recurrent GPipe): the step and its first run do not grow with the '
      'micro-batches, for a slower steady step (docs/benchmarks.md). '
      'False: one call per cell and micro-batch (a step where that makes '
      "TensorFlow's first call slow logs a line saying so). Both compute "
      'the same bits.',
    )
    p.Define(
      'jit_compile',
      False,
      "Compile each cell with XLA: a cell's forward pass on one "
      'micro-batch runs as one XLA computation on its device, and so do '
      'its re-materialization and backward pass together (see '
      '`cell_function.py`). Removes the per-op overhead of small micro-batches '
      'on CPU and GPU; a layer XLA cannot compile is reported when the '
      'pipeline is first traced.',
    )
    p.Define(
      'precompile',
      None,
      "With jit_compile: compile each cell's functions on their devices "
      'while the step is traced, every device at once, instead of at their '
      "first call in the step, in the pipeline's order (device k's compile "
      "waiting for device k-1's). None: on devices of other processes "
      '(worker tasks); True: on every device; False: never.',
    )
    p.Define(
      'share_layer_functions',
      False,
      'Trace each kind of layer of `layers` (the same class and Params '
      'but for the name) once, as a function that its layers call inside '
      "the cells' functions: the step's size and its first-step time then "
      'grow with the kinds of layers, not with their number (see '
      "`layer_function.py`). 'auto': kinds of at least "
      f'{layer_function.AUTO_MIN_OPS} ops (a call costs about 3.5 small '
      'ops); True: every kind of two or more layers; False (the default): '
      'every layer inline in its cell. Deep Transformer stacks gain most; '
      'docs/benchmarks.md has the measured trade-off.',
    )
    p.Define(
      'state_dtype',
      None,
      "Lingvo's dtype of the activations between cells: when set, every "
      "floating output of every cell must have it (a cell's output of "
      'another dtype is an error naming it); None: activations keep the '
      'dtype each cell returns.',
    )
    p.Define(
      'nested_map_fprop',
      False,
      "Lingvo's flag for NestedMap inputs and outputs; either value: "
      'NestedMaps pass between cells as they are.',
    )
    return p

  @classmethod
  def CellParams(cls, p):
    """The cells' Params of pipeline Params `p`: its `cell_tpl` (a stack
    that builds its cells from its own Params, e.g. Lingvo's
    GPipeTransformerStack, returns those), for tools that size a pipeline
    from its Params alone."""
    return list(p.cell_tpl or [])

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.state_dtype is not None:
      try:
        dtype = tf.as_dtype(p.state_dtype)
      except TypeError as e:
        raise ValueError(
          f'PipeliningLayer {p.name!r}: state_dtype={p.state_dtype!r} is not '
          'a dtype; use e.g. tf.float32, or None.'
        ) from e
      if not dtype.is_floating:
        raise ValueError(
          f'PipeliningLayer {p.name!r}: state_dtype={dtype.name} cannot '
          'carry activations (not a float dtype); use the float dtype the '
          'cells return (e.g. tf.float32), or None.'
        )
    if p.share_layer_functions not in ('auto', True, False):
      raise ValueError(
        f'share_layer_functions={p.share_layer_functions!r}; use '
        "'auto', True or False."
      )
    if p.precompile not in (None, True, False):
      raise ValueError(
        f'PipeliningLayer {p.name!r}: precompile={p.precompile!r}; use None '
        '(devices of other processes), True or False.'
      )
    if p.recompute not in RECOMPUTE_POLICIES:
      raise ValueError(
        f'recompute={p.recompute!r}; use one of {RECOMPUTE_POLICIES}.'
      )
    if p.schedule not in SCHEDULES:
      raise ValueError(
        f'PipeliningLayer {p.name!r}: schedule={p.schedule!r}; use one of '
        f'{SCHEDULES}.'
      )
    if not isinstance(p.num_replicas, int) or p.num_replicas < 1:
      raise ValueError(
        f'num_replicas={p.num_replicas!r} must be a positive int.'
      )
    if bool(p.cell_tpl) == bool(p.layers):
      raise ValueError(
        f'PipeliningLayer {p.name!r}: set exactly one of cell_tpl (a list of '
        'cell Params) or layers (a flat list the library splits); got '
        f'{len(p.cell_tpl or [])} cells and {len(p.layers or [])} layers.'
      )
    self._num_micro_batches = p.num_micro_batches
    self._auto_num_stages = None
    self.plan_text = None
    if p.num_stages == 'auto' or p.num_micro_batches == 'auto':
      if p.before_tpl:
        raise ValueError(
          f'PipeliningLayer {p.name!r}: the planner (num_stages or '
          "num_micro_batches = 'auto') does not plan before_tpl layers; "
          'give both as numbers, or move the before_tpl layers to the front '
          'of layers=.'
        )
      self._ResolveAuto()
    if p.cell_tpl:
      cells = []
      for k, cp in enumerate(p.cell_tpl):
        cp = cp.Copy()
        if not cp.name:
          cp.name = f'cell_{k}'
        cells.append(cp)
      if p.num_stages and p.num_stages != len(cells):
        raise ValueError(
          f'num_stages={p.num_stages} but cell_tpl has {len(cells)} cells.'
        )
      self._ranges = None
      num_stages = len(cells)
      self._SetDevices(num_stages)
      self._CreateBefore()
      self._CheckCellShapes([[c] for c in cells])
      self._cell_names = self._CreateNamed(cells, self._DeviceList(), 'cell')
    else:
      layers = [lp.Copy() for lp in p.layers]
      for i, lp in enumerate(layers):
        if not lp.name:
          lp.name = f'layer_{i}'
      self._cell_names = []
      self._splits = self._Splits(layers)
      self._ranges = auto.SplitsToRanges(self._splits)
      num_stages = len(self._splits)
      self._SetDevices(num_stages)
      self._CreateBefore()
      self._CheckCellShapes([layers[a:b] for a, b in self._ranges])
      per_layer = None
      if self._devices:
        per_layer = [
          self._devices[k]
          for k, (a, b) in enumerate(self._ranges)
          for _ in range(a, b)
        ]
      self.CreateChildren('body', layers, devices=per_layer)
    self._num_stages = num_stages
    # Each cell traced once into functions that every work item calls.
    self._cell_functions = cell_function.CellFunctions(
      self._CellFProp,
      self.CellLayers,
      self.path,
      jit_compile=p.jit_compile,
      precompile=p.precompile,
      inline=lambda: self._placement.on_tpu,
      shared=(
        layer_function.SharedLayers(
          list(self.body),
          min_ops=(
            layer_function.AUTO_MIN_OPS
            if p.share_layer_functions == 'auto'
            else 0
          ),
        )
        if self._ranges is not None and p.share_layer_functions
        else None
      ),
      cell_kind=self._CellKind,
    )
    self._input_checked = False

  # -- Construction helpers ----------------------------------------------------

  def _CreateNamed(self, params_list, devices, what):
    """Children named by their Params names (Lingvo's SeqLayer); unnamed
    ones become `<what>_<i>`. Returns the names in order."""
    names = []
    for i, lp in enumerate(params_list):
      lp = base_layer.LayerParams(lp).Copy()
      if not lp.name:
        lp.name = f'{what}_{i}'
      scope = tf.device(devices[i]) if devices else contextlib.nullcontext()
      with scope:
        self.CreateChild(lp.name, lp)
      names.append(lp.name)
    return names

  def _CreateBefore(self):
    """The `before_tpl` layers, on the first cell's device."""
    before = list(self.params.before_tpl or [])
    devices = self._DeviceList()
    self._before_names = self._CreateNamed(
      before, [devices[0]] * len(before) if devices else None, 'before'
    )

  def _ResolveAuto(self):
    """Resolves num_stages / num_micro_batches = 'auto' with the planner."""
    k, m, text = auto.Resolve(self.params)
    if self.params.num_stages == 'auto':
      self._auto_num_stages = k
    self._num_micro_batches = m
    self.plan_text = text

  def _Splits(self, layers):
    return auto.Splits(
      self.params,
      layers,
      self._CellInputShapes(),
      self._auto_num_stages,
      self.path,
    )

  def _SetDevices(self, num_stages):
    """Resolves the devices of every (replica, cell)."""
    devices = self.params.devices
    if (
      self.params.schedule == 'interleaved'
      and self.params.num_replicas == 1
      and not base_layer.IsAbstract()
    ):
      devices = list(devices or placement.DefaultDevices())
      if len(devices) < num_stages:
        # D devices for K = v * D cells: cell k on devices[k mod D].
        devices = [devices[k % len(devices)] for k in range(num_stages)]
    self._placement = placement.StagePlacement(
      devices,
      num_stages,
      self.params.num_replicas,
      self.path,
      abstract=base_layer.IsAbstract(),
    )
    self._devices = self._placement.devices  # Where the variables live.
    self._num_schedule_devices = num_stages
    if self.params.schedule == 'interleaved':
      self._CheckInterleaved(num_stages)

  def _CheckInterleaved(self, num_stages):
    """Cell k must run on device k mod D of the D distinct devices."""
    devices = self._devices
    if not devices:  # Placed by a strategy or abstract: one cell per device.
      return
    distinct = list(dict.fromkeys(devices))
    d_count = len(distinct)
    schedule_check = functools.partial(
      schedule.Interleaved, num_stages, 1, d_count
    )
    try:
      schedule_check()
    except ValueError as e:
      raise ValueError(f'PipeliningLayer {self.params.name!r}: {e}') from e
    circular = [distinct[k % d_count] for k in range(num_stages)]
    if list(devices) != circular:
      raise ValueError(
        f"PipeliningLayer {self.params.name!r}: schedule='interleaved' "
        f'runs cell k on device k mod {d_count}; got devices {devices}. '
        f'Use {circular}.'
      )
    self._num_schedule_devices = d_count

  def _CellInputShapes(self):
    """`input_shapes` after the `before_tpl` layers (what cell 0 takes)."""
    p = self.params
    if p.input_shapes is None or not p.before_tpl:
      return p.input_shapes
    m = sequential.ChainFPropMeta(list(p.before_tpl), *p.input_shapes)
    return list(py_utils.AsTuple(m.out_shapes))

  def _DeviceList(self):
    return list(self._devices) if self._devices else None

  def _CheckCellShapes(self, cells, shapes=None, source=None):
    """`cell_shapes.Check` on `input_shapes` (or `shapes` from `source`)."""
    if shapes is None:
      shapes, source = self._CellInputShapes(), 'input_shapes'
      if shapes is None:
        return
    cell_shapes.Check(self.path, cells, shapes, source)

  def _CellParams(self):
    """Per cell, the list of its layers' Params."""
    if self._ranges is None:
      return [[c.params] for c in self.cells]
    return [[lyr.params for lyr in self.body[a:b]] for a, b in self._ranges]

  def _CheckFirstInput(self, args):
    """Without `input_shapes`, checks the cells on the first input's shapes
    (once), so that a mismatch names its cell and layer."""
    if self._input_checked or self.params.input_shapes is not None:
      return
    self._input_checked = True
    # FPropMeta formulas take shapes (TensorShapes), whatever the dtype.
    shapes = tf.nest.map_structure(
      lambda t: None if t is None else tf.TensorShape(t.shape), list(args)
    )
    with tf.init_scope():
      self._CheckCellShapes(self._CellParams(), shapes, 'the first batch')

  def CheckBatch(self, batch_size):
    """Raises a ValueError naming this pipeline unless its R and M (or
    micro_batch_size) divide `batch_size`; returns (R, M)."""
    return self.engine.Splits(batch_size)

  # -- Introspection -----------------------------------------------------------

  @property
  def cells(self):
    """The cells of `cell_tpl`, in order (also children by name)."""
    return [self.children[n] for n in self._cell_names]

  @property
  def before_layers(self):
    """The `before_tpl` layers, in order."""
    return [self.children[n] for n in self._before_names]

  @property
  def num_stages(self):
    return self._num_stages

  @property
  def num_replicas(self):
    return self.params.num_replicas

  @property
  def devices(self):
    """The device of each cell (of replica 0, which holds the variables)."""
    return list(self._devices) if self._devices else [None] * self._num_stages

  @property
  def replica_devices(self):
    """[[device of each cell] for each replica]."""
    if self._placement.replica_devices is None:
      return [[None] * self._num_stages] * self.num_replicas
    return [list(d) for d in self._placement.replica_devices]

  @property
  def splits(self):
    """Cell end indices into `layers` (None with cell_tpl)."""
    return list(self._splits) if self._ranges is not None else None

  def CellLayers(self, k):
    """The layers of cell k."""
    if self._ranges is None:
      return [self.cells[k]]
    a, b = self._ranges[k]
    return self.body[a:b]

  def Placement(self):
    """[(cell, device, [layer paths])] — which layer runs where (replica
    0's devices, which hold the variables; see `replica_devices`)."""
    return [
      (k, self.devices[k], [lyr.path for lyr in self.CellLayers(k)])
      for k in range(self.num_stages)
    ]

  @property
  def num_micro_batches(self):
    """M (resolved when the Params say 'auto')."""
    return self._num_micro_batches

  def PlacementText(self):
    p = self.params
    m = (
      f'micro-batches of {p.micro_batch_size} examples'
      if p.micro_batch_size
      else f'{self._num_micro_batches} micro-batches'
    )
    if self.num_replicas > 1:
      m += ' per replica'
    lines = [
      f'Pipeline {self.path!r}: {self.num_stages} cells, {m}, '
      f'recompute={p.recompute}'
      + (', XLA-compiled cells' if p.jit_compile else '')
      + (f', schedule={p.schedule}' if p.schedule != 'gpipe' else '')
    ]
    if self.num_replicas > 1:
      lines[0] += (
        f', {self.num_replicas} data-parallel replicas (variables '
        'on replica 0, gradients summed there)'
      )
    if self.plan_text:
      lines.append(f'  {self.plan_text}')
    for k, _, paths in self.Placement():
      lines.append(
        f'  cell {k} on {self._placement.Describe(k)}: {", ".join(paths)}'
      )
    return '\n'.join(lines)

  @classmethod
  def FPropMeta(cls, p, *args):
    layers = list(p.layers) if p.layers else list(p.cell_tpl)
    return sequential.ChainFPropMeta(list(p.before_tpl or []) + layers, *args)

  # -- Computation -------------------------------------------------------------

  def _CellKind(self, k):
    """What cell k computes, for its functions to be shared with cells of
    the same kind (`cell_function.CellFunctions`): the kinds of its layers
    in order, and whether it is the last cell (whose outputs differ)."""
    if self._ranges is None:
      layers = [self.cells[k]]
    else:
      a, b = self._ranges[k]
      layers = list(self.body[a:b])
    return (
      k == self.num_stages - 1,
      tuple(layer_function.KindKey(layer) for layer in layers),
    )

  def _CellTheta(self, theta, k):
    if self._ranges is None:
      return theta[self._cell_names[k]]
    a, b = self._ranges[k]
    return theta.body[a:b]

  def _CellFProp(self, k, theta_k, args, mark=None, fprop=None):
    """Runs cell k; `mark(layer)`, if given, is called before each layer;
    `fprop(layer, theta, args)`, if given, runs each layer of the body."""
    outs = self._RunCell(k, theta_k, args, mark, fprop)
    self._CheckStateDtype(k, outs)
    if k == self.num_stages - 1:
      # The engine joins tensors only: the last cell's None outputs (Lingvo
      # layers return some) are left out, and put back by FProp and by
      # FPropWithLoss (for its loss_fn and in the outputs it returns).
      self._none_outputs = tuple(i for i, x in enumerate(outs) if x is None)
      outs = tuple(x for x in outs if x is not None)
    return outs

  def _WithNones(self, outs):
    """`outs` with the last cell's None outputs back in their places."""
    nones = getattr(self, '_none_outputs', ())
    if not nones:
      return outs
    outs = list(py_utils.AsTuple(outs))
    for i in nones:
      outs.insert(i, None)
    return py_utils.Unwrap(tuple(outs))

  def _CheckStateDtype(self, k, outs):
    """With `state_dtype`, every floating output of cell k must have it."""
    dtype = self.params.state_dtype
    if dtype is None or k == self.num_stages - 1:
      return
    dtype = tf.as_dtype(dtype)
    for i, x in enumerate(tf.nest.flatten(outs)):
      if py_utils.IsTensor(x) and x.dtype.is_floating and x.dtype != dtype:
        raise ValueError(
          f'Pipeline {self.path!r}: state_dtype={dtype.name} cannot carry '
          f'output {i} of cell {k}, a {x.dtype.name} tensor; cast it in the '
          f'cell, or set state_dtype=None (activations keep their dtype).'
        )

  def _RunCell(self, k, theta_k, args, mark=None, fprop=None):
    if self._ranges is None:
      if mark is not None:
        mark(self.cells[k])
      return py_utils.AsTuple(self.cells[k].FProp(theta_k, *args))
    a, _ = self._ranges[k]
    for i, th in enumerate(theta_k):
      layer = self.body[a + i]
      if mark is not None:
        mark(layer)
      if fprop is None:
        args = py_utils.AsTuple(layer.FProp(th, *args))
      else:
        args = py_utils.AsTuple(fprop(layer, th, args))
    return args

  @property
  def engine(self):
    """The `engine.PipelineEngine` that builds this pipeline's schedule."""
    p = self.params
    return engine.PipelineEngine(
      self._cell_functions,
      self._placement,
      self.num_stages,
      batch_dim=p.batch_dim,
      recompute=p.recompute,
      strict_order=p.strict_order,
      name=self.path,
      schedule=self.ScheduleFn(),
      loop=p.micro_batch_loop,
      num_replicas=p.num_replicas,
      num_micro_batches=self._num_micro_batches,
      micro_batch_size=p.micro_batch_size,
    )

  def ScheduleFn(self):
    """fn(num_cells, num_micro_batches) -> [schedule.WorkItem] of
    Params().schedule (or of a subclass's `_schedule`)."""
    if type(self)._schedule is not schedule.FillDrain:
      return type(self)._schedule
    return functools.partial(
      schedule.Build,
      self.params.schedule,
      num_devices=self._num_schedule_devices,
    )

  def ScheduleText(self, num_micro_batches=None):
    """The clock table of this pipeline's schedule."""
    p = self.params
    return schedule.ScheduleText(
      self.num_stages,
      num_micro_batches or p.num_micro_batches,
      schedule=p.schedule,
      num_devices=self._num_schedule_devices,
    )

  def FProp(self, theta, *args):
    """Runs the pipeline. See `_FProp`.

    Inside a `TPUStrategy` replica of several cores, cell k runs on the
    replica's logical core k (`tpu.LogicalDeviceAssigner`); the strategy's
    replicas are the data parallelism, so num_replicas must then be 1.
    """
    args = microbatch.ToTensors(args)  # NumPy inputs split like tensors.
    with self._placement.Call():
      return self._FProp(theta, *args)

  @tf.autograph.experimental.do_not_convert
  def _FProp(self, theta, *args):
    """Runs the pipeline.

    In evaluation and inference (`do_eval`), a batch that R*M does not
    divide, or whose size is unknown when the graph is built (an exported
    model), runs as one micro-batch on replica 0: no gradients, so nothing to
    pipeline for memory.

    Args:
      theta: this layer's theta.
      *args: inputs of the first cell (tensors or NestedMaps), each with the
        batch along `batch_dim`.

    Returns:
      The last cell's outputs for the whole mini-batch.
    """
    p = self.params
    args = self._RunBefore(theta, args)
    thetas, seed = self._Prepare(theta, args)
    if self.do_eval:
      return self._WithNones(self.engine.Evaluate(thetas, args, seed))
    if p.schedule == '1f1b' and _tf_internal.CouldPossiblyRecord():
      raise ValueError(
        f"Pipeline {self.path!r} has schedule='1f1b', which starts a "
        "micro-batch's backward before the other micro-batches' forwards, "
        "so it needs each micro-batch's loss on the last cell; FProp "
        'returns only the outputs. Train with '
        'FPropWithLoss(theta, *inputs, loss_fn=fn) instead, fn(outputs of '
        "one micro-batch) -> its share of the loss (a task's "
        'ComputePredictions does this for its network), or use '
        "schedule='gpipe'."
      )
    return self._WithNones(self.engine.ForwardWithGrad(thetas, args, seed))

  def _RunBefore(self, theta, args):
    """Runs the `before_tpl` layers on the whole mini-batch on the first
    cell's device (outside the pipeline, as Lingvo's SeqLayer does)."""
    if not self._before_names:
      return args
    with self._placement.Scope(0):
      for name in self._before_names:
        args = py_utils.AsTuple(self.children[name].FProp(theta[name], *args))
    return args

  def _Prepare(self, theta, args):
    """(each cell's theta, the step seed), after checking the cells on the
    first input's shapes."""
    self._CheckFirstInput(args)
    thetas = [self._CellTheta(theta, k) for k in range(self.num_stages)]
    return thetas, py_utils.CurrentStepSeed()

  @tf.autograph.experimental.do_not_convert
  def FPropWithLoss(
    self, theta, *args, loss_fn, loss_inputs=None, loss_theta=None
  ):
    """Runs the pipeline with each micro-batch's loss on the last cell.

    Every schedule works this way; '1f1b' needs it for training. The
    forward and backward work items run in the schedule's order (a
    micro-batch's backward starts as soon as its loss is known), all inside
    this call; the returned loss is recorded on the gradient tape as one
    operation, so `tape.gradient(loss, ...)` (and the learner) get exactly
    the gradients of the sequential model's loss.

    Args:
      theta: this layer's theta.
      *args: inputs of the first cell, as for FProp.
      loss_fn: one micro-batch's share of the mini-batch loss, a float
        scalar, given the last cell's outputs on that micro-batch (as FProp
        returns them): fn(outputs); fn(outputs, loss_inputs) with
        `loss_inputs`; fn(outputs, loss_inputs, loss_theta) with
        `loss_theta` (loss_inputs None if not given). The shares are
        summed, so a mean over the mini-batch divides by the mini-batch's
        size (or total weight), e.g. `lambda out: tf.reduce_sum(out) /
        batch_size`.
      loss_inputs: optional structure of tensors with the batch along
        `batch_dim` (labels, weights), split into micro-batches like the
        inputs and passed to loss_fn.
      loss_theta: optional structure of weights (float tensors, e.g. the
        theta of a softmax layer outside the pipeline) that loss_fn uses;
        they go to the last cell's device, and their gradients (summed over
        the micro-batches) flow back through the returned loss like the
        cells'. loss_fn must use them, not read variables.

    Returns:
      (loss, outputs): the summed loss (differentiable w.r.t. theta,
      loss_theta and the float inputs) and the last cell's outputs for the
      whole mini-batch (no gradient flows back through them; use them for
      metrics).
    """
    if not callable(loss_fn):
      raise TypeError(
        f'Pipeline {self.path!r}: FPropWithLoss needs loss_fn=fn(outputs) '
        f'-> scalar; got {loss_fn!r}.'
      )
    args, loss_inputs = microbatch.ToTensors((args, loss_inputs))
    with self._placement.Call():
      return self._FPropWithLoss(theta, args, loss_fn, loss_inputs, loss_theta)

  @tf.autograph.experimental.do_not_convert
  def _FPropWithLoss(self, theta, args, loss_fn, loss_inputs, loss_theta):
    args = self._RunBefore(theta, args)
    thetas, seed = self._Prepare(theta, args)

    def LossFn(outputs, mb, loss_theta_r):
      outputs = self._WithNones(outputs)  # as FProp returns them
      if loss_theta is not None:
        return loss_fn(outputs, mb, loss_theta_r)
      if loss_inputs is not None:
        return loss_fn(outputs, mb)
      return loss_fn(outputs)

    loss, outs = self.engine.WithLoss(
      thetas,
      args,
      seed,
      LossFn,
      loss_inputs=loss_inputs,
      loss_theta=loss_theta,
      lenient=self.do_eval,
    )
    return loss, self._WithNones(outs)
