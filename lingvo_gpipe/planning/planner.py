"""The planner: chooses K, M, R, the split and re-materialization.

From a model's layer Params and input shapes it builds a per-layer profile
without allocating any weight (`ProfileLayers`): forward flops, output
bytes, parameter bytes, the bytes of the intermediate activations and the
number of ops, all read from the layer's abstractly traced `FProp` graph
(or its `FPropMeta` formula). `MeasureProfile` adds the measured per-layer
times of this host; `MeasureLink` the transfer bandwidth between two local
TensorFlow server workers. For every candidate (R replicas, K cells, M
micro-batches, GPipe's fill-drain, the 1F1B or the interleaved schedule (K
cells on K/v devices, v = 2..4), recompute on or off, cells balanced by
time or by memory), `Plan` groups the layers into `cost_model.CellCost`s
and simulates the schedule (`cost_model.Simulate`): predicted step time,
peak memory per device, bubble and bytes sent. Candidates are ranked by step
time; the others are rejected with a reason: does not fit (and what
dominates memory), bubble-bound or transfer-bound.

  profile = planner.ProfileLayers(layers, [[batch, dim]])
  result = planner.Plan(profile, device_presets.GetPreset('tpu_v3'),
                        num_devices=8)
  print(result.ToText())

`PipeliningLayer(num_stages='auto', num_micro_batches='auto')` calls
`Resolve` at build time.
"""

import dataclasses

import tensorflow as tf

from lingvo_gpipe.planning import balance
from lingvo_gpipe.planning import cost_model
from lingvo_gpipe.planning import device_presets
from lingvo_gpipe.planning.layer_profile import FormatBytes  # noqa: F401
from lingvo_gpipe.planning.layer_profile import InputDuplicateBytes
from lingvo_gpipe.planning.layer_profile import LayerProfile  # noqa: F401
from lingvo_gpipe.planning.layer_profile import MeasureLink  # noqa: F401
from lingvo_gpipe.planning.layer_profile import MeasureProfile  # noqa: F401
from lingvo_gpipe.planning.layer_profile import MeasuredDevice  # noqa: F401
from lingvo_gpipe.planning.layer_profile import ModelProfile  # noqa: F401
from lingvo_gpipe.planning.layer_profile import ProfileLayers  # noqa: F401


__all__ = [
  'LayerProfile',
  'ModelProfile',
  'ProfileLayers',
  'MeasureProfile',
  'MeasureLink',
  'MeasuredDevice',
  'CellCosts',
  'CheckShape',
  'Candidate',
  'PlanResult',
  'Plan',
  'Evaluate',
  'Resolve',
  'DetectDevice',
  'FormatBytes',
  'InputDuplicateBytes',
]


def _FormatS(s):
  if s >= 1:
    return f'{s:.3f} s'
  if s >= 1e-3:
    return f'{s * 1e3:.2f} ms'
  return f'{s * 1e6:.1f} us'


# A fitting configuration whose devices idle more than this share of the
# step is bubble-bound.
BUBBLE_BOUND = 0.5
# ... or whose step would be this much shorter with free links,
# transfer-bound.
TRANSFER_BOUND = 0.3


# -----------------------------------------------------------------------------
# Candidates.
# -----------------------------------------------------------------------------


@dataclasses.dataclass
class Candidate:
  """One configuration and its prediction."""

  num_replicas: int
  num_stages: int
  num_micro_batches: int
  recompute: bool
  split_by: str
  splits: list
  step_s: float = 0.0
  examples_per_s: float = 0.0
  busy_fraction: list = None
  bubble: float = 0.0
  peak_bytes: list = None
  memory: dict = None  # breakdown of the device with the largest peak
  bytes_sent: list = None
  free_link_step_s: float = 0.0
  fits: bool = True
  verdict: str = 'ok'
  reason: str = ''
  events: list = None
  schedule: str = 'gpipe'
  # Cells per device: 'interleaved' runs K cells on K / v devices.
  virtual_stages: int = 1

  @property
  def num_devices(self):
    """Devices of one replica: K, or K / v for 'interleaved'."""
    return self.num_stages // self.virtual_stages

  @property
  def max_peak_bytes(self):
    return max(self.peak_bytes)

  def Dominant(self):
    """(what, bytes): the largest share of the fullest device's memory."""
    groups = {
      'weights, gradients and optimizer slots': self.memory['weights']
      + self.memory['gradients']
      + self.memory.get('compiled_gradients', 0)
      + self.memory['optimizer_slots'],
      'stored micro-batch inputs': self.memory['stored_inputs'],
      'activations': self.memory['activations']
      + self.memory.get('backward_temporaries', 0),
      'output gradients received ahead of their backward': self.memory.get(
        'received_gradients', 0
      ),
      'optimizer update temporaries': self.memory.get('update_temporaries', 0),
    }
    what = max(groups, key=groups.get)
    return what, groups[what]

  def Label(self):
    rc = 'recompute' if self.recompute else 'no recompute'
    sched = '' if self.schedule == 'gpipe' else f' {self.schedule}'
    if self.virtual_stages > 1:
      sched += f' on {self.num_devices} devices'
    return (
      f'R={self.num_replicas} K={self.num_stages} M={self.num_micro_batches}'
      f'{sched} {rc}, split by {self.split_by} {self.splits}'
    )

  def ToDict(self):
    d = dataclasses.asdict(self)
    d.pop('events')
    d['max_peak_bytes'] = self.max_peak_bytes
    d['num_devices'] = self.num_devices
    d['dominant_memory'] = self.Dominant()[0]
    return d


def CellCosts(profile, splits, m, r, device):
  """One `cost_model.CellCost` per cell of `splits` for a micro-batch of
  batch / (m * r) examples on `device`."""
  frac = 1.0 / (m * r)
  batch = profile.batch_size
  cells = []
  start = 0
  for end in splits:
    lps = profile.layers[start:end]
    fwd = bwd = 0.0
    for lp in lps:
      f, b = lp.TimesS(frac, batch, device)
      fwd += f
      bwd += b
    cells.append(
      cost_model.CellCost(
        fprop_s=fwd,
        bprop_s=bwd,
        out_bytes=int(lps[-1].out_bytes * frac),
        weight_bytes=sum(lp.param_bytes for lp in lps),
        input_bytes=int(lps[0].in_bytes * frac),
        # A ReLU of a state that two layers of the cell read is one buffer.
        activation_bytes=int(
          (sum(lp.activation_bytes for lp in lps) - InputDuplicateBytes(lps))
          * frac
        ),
        backward_bytes=int(max(lp.backward_bytes for lp in lps) * frac),
        max_var_bytes=max(lp.max_var_bytes for lp in lps),
      )
    )
    start = end
  return cells


def Evaluate(
  profile,
  device,
  num_stages,
  num_micro_batches,
  recompute=True,
  num_replicas=1,
  splits=None,
  split_by='time',
  memory_bytes=None,
  optimizer_slots=2,
  compiled=False,
  schedule='gpipe',
  virtual_stages=1,
):
  """Predicts one configuration; returns a `Candidate` (`compiled`: the
  cells are XLA-compiled, see `cost_model.MemoryBreakdown`; `schedule`:
  one of `cost_model.SIMULATED_SCHEDULES`; `virtual_stages`: v cells per
  device, for 'interleaved')."""
  k, m, r = num_stages, num_micro_batches, num_replicas
  devices = k // virtual_stages
  if splits is None:
    splits = _Splits(profile, k, split_by, device, optimizer_slots)
  spec = device.Spec(memory_bytes)
  cells = CellCosts(profile, splits, m, r, device)
  sync_s = 0.0
  if r > 1:
    # Replicas 1..R-1 read each cell's weights from replica 0 before the
    # step and send their gradients back after it, one link per cell.
    sync_s = (r - 1) * max(
      spec.link_latency_s + c.weight_bytes / spec.link_bytes_per_s
      for c in cells
    )
  sim = cost_model.Simulate(
    cells,
    m,
    spec,
    recompute,
    optimizer_slots,
    start_s=sync_s,
    end_s=sync_s,
    compiled=compiled,
    schedule_name=schedule,
    num_devices=devices,
  )
  free = cost_model.Simulate(
    cells,
    m,
    spec._replace(link_bytes_per_s=float('inf'), link_latency_s=0.0),
    recompute,
    optimizer_slots,
    schedule_name=schedule,
    num_devices=devices,
  )
  peaks = list(sim.peak_memory)
  worst = max(range(len(peaks)), key=lambda i: peaks[i])
  cand = Candidate(
    num_replicas=r,
    num_stages=k,
    num_micro_batches=m,
    recompute=bool(recompute),
    split_by=split_by,
    splits=list(splits),
    step_s=sim.step_s,
    examples_per_s=profile.batch_size / sim.step_s,
    busy_fraction=list(sim.busy_fraction),
    # One cell per replica has no pipeline bubble (its idle time is the
    # replicas' weight and gradient transfers, in step_s).
    bubble=0.0 if k == 1 else 1.0 - sum(sim.busy_fraction) / devices,
    peak_bytes=peaks,
    memory=sim.memory[worst],
    bytes_sent=list(sim.bytes_sent),
    free_link_step_s=free.step_s,
    events=sim.events,
    schedule=schedule,
    virtual_stages=virtual_stages,
  )
  limit = spec.memory_bytes
  if cand.max_peak_bytes > limit:
    what, nbytes = cand.Dominant()
    cand.fits = False
    cand.verdict = 'does not fit'
    cand.reason = (
      f'needs {FormatBytes(cand.max_peak_bytes)} on device {worst} > '
      f'{FormatBytes(limit)}; {what} dominate ({FormatBytes(nbytes)})'
    )
  elif (cand.step_s - free.step_s) > TRANSFER_BOUND * cand.step_s:
    cand.verdict = 'transfer-bound'
    cand.reason = (
      f'{100 * (cand.step_s - free.step_s) / cand.step_s:.0f}% of the step '
      'waits for transfers between devices'
    )
  elif cand.bubble > BUBBLE_BOUND:
    cand.verdict = 'bubble-bound'
    cand.reason = (
      f'devices idle {100 * cand.bubble:.0f}% of the step (the '
      f'bubble (K-1)/(M+K-1) and imbalance); use M >= 4K'
    )
  return cand


def _Splits(profile, k, split_by, device, optimizer_slots):
  if split_by == 'time':
    costs = [
      sum(lp.TimesS(1.0, profile.batch_size, device)) for lp in profile.layers
    ]
  elif split_by == 'memory':
    costs = [
      lp.param_bytes * (2 + optimizer_slots) + lp.activation_bytes
      for lp in profile.layers
    ]
  else:
    raise ValueError(f'split_by={split_by!r}; use time or memory.')
  return balance.BalancedSplits(costs, k)


# The most cells per device the planner tries for 'interleaved'.
MAX_VIRTUAL_STAGES = 4


def _Shapes(num_layers, max_devices, num_stages, plain, interleaved, max_v):
  """[(K, v, schedules)] to try on at most `max_devices` devices per
  replica: K cells on K / v devices; v = 1 for the `plain` schedules (one
  cell per device), v = 2 .. `max_v` for 'interleaved' on D >= 2
  devices. A fixed `num_stages` fixes K."""
  out = []
  if plain:
    if num_stages:
      ks = [num_stages] if num_stages <= max_devices else []
    else:
      ks = range(1, min(num_layers, max_devices) + 1)
    out += [(k, 1, plain) for k in ks]
  if interleaved:
    for d in range(2, max_devices + 1):
      for v in range(2, max_v + 1):
        k = v * d
        if k <= num_layers and (not num_stages or k == num_stages):
          out.append((k, v, ('interleaved',)))
  return out


def _Divisors(n, limit):
  return [m for m in range(1, min(n, limit) + 1) if n % m == 0]


def _Bubble(cand):
  """The bubble column: '-' for one stage (no pipeline, no bubble)."""
  return '-' if cand.num_stages == 1 else f'{100 * cand.bubble:.0f}%'


@dataclasses.dataclass
class PlanResult:
  """The ranked feasible candidates and the rejected ones."""

  model: str
  device: object
  num_devices: int
  memory_bytes: int
  feasible: list
  rejected: list

  @property
  def best(self):
    return self.feasible[0] if self.feasible else None

  def SmallestNeed(self):
    """The candidate that needs the least memory on its fullest device."""
    everything = self.feasible + self.rejected
    return min(everything, key=lambda c: c.max_peak_bytes)

  def ToText(self, top=10, rejected_per_reason=3):
    d = self.device
    lines = [
      f'Plan for {self.model} on {self.num_devices} x {d.name} '
      f'({FormatBytes(self.memory_bytes)} each): {d.description}.'
    ]
    if not self.feasible:
      need = self.SmallestNeed()
      what, nbytes = need.Dominant()
      lines.append(
        f'No configuration fits in {FormatBytes(self.memory_bytes)} per '
        f'device. The smallest need is {FormatBytes(need.max_peak_bytes)} '
        f'({need.Label()}); {what} dominate it ({FormatBytes(nbytes)}). '
        'Give devices more memory (--memory_per_device), more devices, or '
        'a smaller model or batch.'
      )
    else:
      head = (
        f'{"#":>3} {"R":>2} {"K":>3} {"D":>3} {"M":>4} {"schedule":>11} '
        f'{"recompute":>9} {"step":>10} {"examples/s":>11} {"bubble":>6} '
        f'{"peak/device":>12}  splits (by)'
      )
      lines += [
        'Feasible, best first (R replicas of K cells on D devices each):',
        head,
        '-' * len(head),
      ]
      for i, c in enumerate(self.feasible[:top]):
        note = '' if c.verdict == 'ok' else f'  [{c.verdict}]'
        lines.append(
          f'{i + 1:>3} {c.num_replicas:>2} {c.num_stages:>3} '
          f'{c.num_devices:>3} '
          f'{c.num_micro_batches:>4} {c.schedule:>11} '
          f'{"yes" if c.recompute else "no":>9} '
          f'{_FormatS(c.step_s):>10} {c.examples_per_s:>11.4g} '
          f'{_Bubble(c):>6} '
          f'{FormatBytes(c.max_peak_bytes):>12}  {c.splits} '
          f'({c.split_by}){note}'
        )
      if len(self.feasible) > top:
        lines.append(f'... and {len(self.feasible) - top} more feasible.')
    by_reason = {}
    for c in self.rejected:
      by_reason.setdefault(c.verdict, []).append(c)
    if by_reason:
      lines.append('Rejected:')
    for verdict, cands in by_reason.items():
      lines.append(f'  {verdict}: {len(cands)} configurations, e.g.')
      for c in sorted(cands, key=lambda c: c.step_s)[:rejected_per_reason]:
        lines.append(f'    {c.Label()}: {c.reason}.')
    return '\n'.join(lines)

  def ToDict(self):
    return dict(
      model=self.model,
      device=dataclasses.asdict(self.device),
      num_devices=self.num_devices,
      memory_bytes=self.memory_bytes,
      feasible=[c.ToDict() for c in self.feasible],
      rejected=[c.ToDict() for c in self.rejected],
    )


def CheckShape(num_layers, num_devices, num_stages=None, num_replicas=None):
  """Raises ValueError for K or R that the layers or devices cannot take."""
  if not isinstance(num_devices, int) or num_devices < 1:
    raise ValueError(
      f'num_devices={num_devices!r}: give a positive number of devices.'
    )
  if num_stages is not None:
    if num_stages < 1 or num_stages > num_layers:
      raise ValueError(
        f'num_stages={num_stages} but the model has {num_layers} layers: '
        f'K must lie in [1, {min(num_layers, num_devices)}] (every cell '
        'needs a layer and a device).'
      )
  r = num_replicas or 1
  k = num_stages or 1
  if k * r > num_devices:
    if num_stages and num_replicas:
      fix = (
        f'with R={r}, K must lie in [1, {max(1, num_devices // r)}]; with '
        f'K={k}, R in [1, {max(1, num_devices // k)}]'
      )
    elif num_stages:
      fix = f'K must lie in [1, {min(num_layers, num_devices)}]'
    else:
      fix = f'R must lie in [1, {num_devices}]'
    raise ValueError(
      f'K={k} x R={r} = {k * r} devices, but only {num_devices} are given: '
      f'{fix}.'
    )


def Plan(
  profile,
  device,
  num_devices,
  memory_bytes=None,
  optimizer_slots=2,
  num_stages=None,
  num_micro_batches=None,
  num_replicas=None,
  recompute=None,
  max_micro_batches=64,
  split_by=('time', 'memory'),
  compiled=False,
  schedules=cost_model.SIMULATED_SCHEDULES,
  max_virtual_stages=MAX_VIRTUAL_STAGES,
):
  """Predicts every candidate; returns a `PlanResult`.

  Args:
    profile: a `ModelProfile`.
    device: a `device_presets.Device`.
    num_devices: devices available; candidates use K * R <= num_devices.
    memory_bytes: memory per device (default: the device's).
    optimizer_slots: optimizer slots per weight (Adam 2, SGD 0).
    num_stages: fixes K (None: search).
    num_micro_batches: fixes M (None: search).
    num_replicas: fixes R (None: search).
    recompute: fixes re-materialization (None: search both).
    max_micro_batches: the largest M tried.
    split_by: how cells are balanced: by 'time' and/or by 'memory'.
    compiled: the cells are XLA-compiled (`jit_compile`; memory only).
    schedules: the schedules tried ('gpipe', '1f1b', 'interleaved'). With
      one cell or one micro-batch 'gpipe' and '1f1b' are the same, and only
      the first is tried. At equal step time the smaller peak ranks first:
      1F1B holds K - k micro-batches in flight where GPipe holds M.
      'interleaved' runs K = v * D cells on D >= 2 devices (v = 2 ..
      `max_virtual_stages`; a fixed `num_stages` is K, the cells).
    max_virtual_stages: the most cells per device tried for 'interleaved'.
  """
  for name in schedules:
    if name not in cost_model.SIMULATED_SCHEDULES:
      raise ValueError(
        f'schedule {name!r}: the planner predicts '
        f'{", ".join(cost_model.SIMULATED_SCHEDULES)}.'
      )
  num_layers = profile.num_layers
  plain = tuple(s for s in schedules if s != 'interleaved')
  # 'interleaved' alone: a fixed K is cells, which may outnumber devices.
  CheckShape(
    num_layers, num_devices, num_stages if plain else None, num_replicas
  )
  if num_stages is not None and not plain and not 2 <= num_stages <= num_layers:
    raise ValueError(
      f"num_stages={num_stages} with schedule 'interleaved': K cells on "
      f'fewer devices need 2 <= K <= {num_layers} (the layers).'
    )
  memory_bytes = int(memory_bytes or device.memory_bytes)
  batch = profile.batch_size
  reps = [num_replicas] if num_replicas else range(1, num_devices + 1)
  recomputes = [recompute] if recompute is not None else [True, False]
  splits_cache = {}
  cands = []
  for r in reps:
    if batch % r:
      continue
    shapes = _Shapes(
      num_layers,
      num_devices // r,
      num_stages,
      plain,
      'interleaved' in schedules and r == 1,  # The layer's: one replica.
      max_virtual_stages,
    )
    for k, v, scheds_kv in shapes:
      if num_micro_batches:
        ms = (
          [num_micro_batches] if (batch // r) % num_micro_batches == 0 else []
        )
      else:
        ms = _Divisors(batch // r, max_micro_batches)
      bys = split_by if k > 1 else split_by[:1]
      for by in bys:
        key = (k, by)
        if key not in splits_cache:
          splits_cache[key] = _Splits(profile, k, by, device, optimizer_slots)
        splits = splits_cache[key]
        if by != bys[0] and splits == splits_cache[(k, bys[0])]:
          continue
        for m in ms:
          scheds = scheds_kv if k > 1 and m > 1 else scheds_kv[:1]
          for rc in recomputes:
            for sched in scheds:
              cands.append(
                Evaluate(
                  profile,
                  device,
                  k,
                  m,
                  rc,
                  r,
                  splits,
                  by,
                  memory_bytes,
                  optimizer_slots,
                  compiled,
                  sched,
                  v,
                )
              )
  if not cands:
    raise ValueError(
      f'No configuration: the batch of {batch} is not divisible by '
      f'num_replicas={num_replicas} or num_micro_batches='
      f'{num_micro_batches}; use divisors of {batch}.'
    )
  cands.sort(key=lambda c: (c.step_s, c.max_peak_bytes))
  fitting = [c for c in cands if c.fits]
  any_ok = any(c.verdict == 'ok' for c in fitting)
  feasible = [c for c in fitting if c.verdict == 'ok' or not any_ok]
  rejected = [c for c in cands if c not in feasible]
  return PlanResult(
    model=profile.name,
    device=device,
    num_devices=num_devices,
    memory_bytes=memory_bytes,
    feasible=feasible,
    rejected=rejected,
  )


# -----------------------------------------------------------------------------
# 'auto' in PipeliningLayer.
# -----------------------------------------------------------------------------


def DetectDevice(devices):
  """The preset that best describes `devices` (TensorFlow device names):
  the GPU preset named in the GPU's name, else 'cpu'."""
  name = (devices or [''])[0] or ''
  if 'GPU' in name.upper():
    try:
      gpus = tf.config.list_physical_devices('GPU')
      details = tf.config.experimental.get_device_details(gpus[0])
      model = details.get('device_name', '').lower()
    except (IndexError, ValueError, RuntimeError):
      model = ''
    for key in ('h100', 'a100', 'v100'):
      if key in model:
        return device_presets.PRESETS[key]
    return device_presets.PRESETS['v100']
  if 'TPU' in name.upper():
    return device_presets.PRESETS['tpu_v3']
  return device_presets.PRESETS['cpu']


def Resolve(
  layer_params,
  input_shapes,
  num_devices,
  num_stages='auto',
  num_micro_batches='auto',
  num_replicas=1,
  recompute=True,
  device=None,
  memory_bytes=None,
  batch_dim=0,
  name='pipeline',
  split_by=('time',),
  compiled=False,
  schedule='gpipe',
):
  """Chooses K and/or M for a pipeline; returns (K, M, Candidate, text).

  `num_stages` / `num_micro_batches` are 'auto' or fixed ints; K * R is at
  most `num_devices`; M divides the per-replica batch. The pipeline's
  `schedule` is predicted as itself for 'gpipe' and '1f1b'; an
  'interleaved' pipeline's K cells are its devices here (its layer
  places them), so it is predicted as 'gpipe'.
  """
  if input_shapes is None:
    raise ValueError(
      f"Pipeline {name!r}: num_stages/num_micro_batches='auto' need "
      'input_shapes with the batch size (e.g. [[64, 1024]]) so that the '
      'planner can predict time and memory; set input_shapes or give '
      'num_stages and num_micro_batches.'
    )
  if isinstance(device, str):
    device = device_presets.GetPreset(device)
  profile = ProfileLayers(layer_params, input_shapes, batch_dim, name)
  k = None if num_stages == 'auto' else num_stages
  m = None if num_micro_batches == 'auto' else num_micro_batches
  result = Plan(
    profile,
    device,
    num_devices,
    memory_bytes=memory_bytes,
    num_stages=k,
    num_micro_batches=m,
    num_replicas=num_replicas,
    recompute=recompute,
    split_by=split_by,
    compiled=compiled,
    schedules=((schedule,) if schedule in ('gpipe', '1f1b') else ('gpipe',)),
  )
  best = result.best
  if best is None:
    need = result.SmallestNeed()
    what, nbytes = need.Dominant()
    raise ValueError(
      f'Pipeline {name!r}: no K (<= {num_devices // num_replicas}) and M '
      f'fit in {FormatBytes(result.memory_bytes)} per device '
      f'({device.name}); the smallest need is '
      f'{FormatBytes(need.max_peak_bytes)} ({need.Label()}), dominated by '
      f'{what} ({FormatBytes(nbytes)}). Use more devices or '
      'planner_memory_per_device if the devices have more memory.'
    )
  auto = [
    n
    for n, v in (
      ('num_stages', num_stages),
      ('num_micro_batches', num_micro_batches),
    )
    if v == 'auto'
  ]
  text = (
    f'planned ({", ".join(a + "=auto" for a in auto)}; device preset '
    f'{device.name}, {FormatBytes(result.memory_bytes)} per device): '
    f'K={best.num_stages}, M={best.num_micro_batches}; predicted step '
    f'{_FormatS(best.step_s)}, '
    + ('' if best.num_stages == 1 else f'bubble {_Bubble(best)}, ')
    + 'peak '
    f'{FormatBytes(best.max_peak_bytes)} per device, '
    f'{len(result.feasible)} feasible of '
    f'{len(result.feasible) + len(result.rejected)} configurations'
  )
  return best.num_stages, best.num_micro_batches, best, text
