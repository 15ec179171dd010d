"""The planner's prediction for the 608M LM as trained (K=8, M=4, the
registered split, recompute): per-cell peak bytes and step time."""

import json
import sys
import tensorflow as tf
from lingvo_gpipe import model_registry, trainer
from lingvo_gpipe.planning import device_presets
from lingvo_gpipe.planning import layer_profile
from lingvo_gpipe.planning import planner

key = (
  sys.argv[1]
  if len(sys.argv) > 1
  else 'lm.one_billion_wds.OneBWdsGPipeTransformerHalfB'
)
device_name = sys.argv[2] if len(sys.argv) > 2 else 'cpu'
p = model_registry.GetParams(key, 'Train')
_, lp = trainer.PipelineLayers(p)[0]
cells = lp.cls.CellParams(lp)
layers, ends = [], []
for c in cells:
  layers += list(c.sub)
  ends.append(len(layers))
b, t = p.input.batch_size, p.input.max_tokens
specs = [
  tf.TensorSpec([b, t], tf.int32),
  tf.TensorSpec([b, t], tf.float32),
  None,
  None,
  None,
  None,
  tf.TensorSpec([b, t], tf.int32),
  tf.TensorSpec([b, t], tf.float32),
]
prof = layer_profile.ProfileLayers(layers, specs)
if device_name == 'measure':
  planner.MeasureProfile(prof, layers, time_budget_s=120)
  device = planner.MeasuredDevice(8 << 30)
else:
  device = device_presets.GetPreset(device_name)
cand = planner.Evaluate(
  prof,
  device,
  num_stages=len(ends),
  num_micro_batches=lp.num_micro_batches,
  recompute=True,
  splits=ends,
  memory_bytes=8 << 30,
  optimizer_slots=2,
)
out = dict(
  splits=ends,
  peak_bytes=cand.peak_bytes,
  step_s=cand.step_s,
  busy_s=[f * cand.step_s for f in cand.busy_fraction],
  params=[
    sum(l.num_params for l in prof.layers[s:e])
    for s, e in zip([0] + ends[:-1], ends)
  ],
  memory_worst=str(cand.memory),
)
print(json.dumps(out, indent=1))
