"""The paper's tables, predicted: Table 2 (throughput of the paper's
Transformer-48 and AmoebaNet-D(18, 256) per K and M, normalized to K=2,
M=1) and Table 1 (the largest Transformer per K within 16 GB per core).
`python tools/plan.py --paper_table2` and `--paper_table1` print them.
"""

import json

from lingvo_gpipe.planning import cost_model
from lingvo_gpipe.planning import device_presets
from lingvo_gpipe.planning import planner
from lingvo_gpipe.tools.common import GIB
from lingvo_gpipe.tools.common import ParseBytes

# The paper's Table 2 (throughput normalized to K=2, M=1) and Table 1
# (the largest Transformer per K: layers, with 16 GB per TPU core).
PAPER_TABLE2 = {
  'amoebanet_d18_256': {
    (2, 1): 1.0,
    (4, 1): 1.13,
    (8, 1): 1.38,
    (2, 4): 1.07,
    (4, 4): 1.26,
    (8, 4): 1.72,
    (2, 32): 1.21,
    (4, 32): 1.84,
    (8, 32): 3.48,
  },
  'transformer48': {
    (2, 1): 1.0,
    (4, 1): 1.07,
    (8, 1): 1.3,
    (2, 4): 1.7,
    (4, 4): 3.2,
    (8, 4): 4.8,
    (2, 32): 1.8,
    (4, 32): 3.4,
    (8, 32): 6.3,
  },
}


PAPER_TABLE1_TRANSFORMER = {1: 13, 8: 103, 32: 415, 128: 1663}


PAPER_TABLE1_NAIVE = 3


# The paper's Table 1 Transformer: vocabulary 32k, 1024 tokens, batch 32,
# model dim 2048, FFN 8192, 32 heads.
PAPER_TRANSFORMER = dict(
  model_dim=2048, hidden_dim=8192, num_heads=32, vocab_size=32000
)


PAPER_SEQ_LEN = 1024


PAPER_BATCH = 32


PAPER_AMOEBANET_BATCH = 128


def PaperTransformer(num_layers=48, batch=PAPER_BATCH):
  from lingvo_gpipe.models import transformer_lm  # pylint: disable=g-import-not-at-top

  layers = transformer_lm.LayerParams(
    num_layers=num_layers, **PAPER_TRANSFORMER
  )
  return layers, [[batch, PAPER_SEQ_LEN], [batch, PAPER_SEQ_LEN]]


def PaperAmoebaNet(batch=PAPER_AMOEBANET_BATCH):
  from lingvo_gpipe.models import amoebanet  # pylint: disable=g-import-not-at-top

  net = (
    amoebanet.AmoebaNet.Params()
    .Set(num_cells=18, num_filters=256, image_size=224, num_classes=1000)
    .Instantiate()
  )
  return net.Layers(), [net.InputShape(batch)]


def PaperTable2(args):
  """Records of the paper's Table 2 predicted with the TPU preset."""
  device = device_presets.GetPreset(args.paper_device)
  records = []
  for model, builder in (
    ('transformer48', lambda: PaperTransformer(48)),
    ('amoebanet_d18_256', PaperAmoebaNet),
  ):
    layers, shapes = builder()
    profile = planner.ProfileLayers(layers, shapes, name=model)
    preds = {}
    for (k, m), _ in PAPER_TABLE2[model].items():
      cand = planner.Evaluate(profile, device, k, m, True, 1, split_by='time')
      preds[(k, m)] = cand
    base = preds[(2, 1)].examples_per_s
    for (k, m), paper in PAPER_TABLE2[model].items():
      c = preds[(k, m)]
      records.append(
        dict(
          model=model,
          device=device.name,
          num_stages=k,
          num_micro_batches=m,
          batch_size=profile.batch_size,
          predicted_step_s=c.step_s,
          bubble=c.bubble,
          predicted_normalized=c.examples_per_s / base,
          paper_normalized=paper,
          ratio=c.examples_per_s / base / paper,
          peak_bytes_per_device=c.max_peak_bytes,
        )
      )
  lines = [
    f"The paper's Table 2 predicted on {device.name} ({device.description}), "
    'throughput normalized to K=2, M=1:',
    f'{"model":>18} {"K":>2} {"M":>3} {"predicted":>9} {"paper":>6} '
    f'{"ratio":>6} {"bubble":>6}',
  ]
  for r in records:
    lines.append(
      f'{r["model"]:>18} {r["num_stages"]:>2} {r["num_micro_batches"]:>3} '
      f'{r["predicted_normalized"]:>9.2f} {r["paper_normalized"]:>6.2f} '
      f'{r["ratio"]:>6.2f} {100 * r["bubble"]:>5.0f}%'
    )
  print('\n'.join(lines))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(records, f, indent=1)
    print(f'Wrote {args.json}')
  return records


def LargestTransformer(device, num_stages, memory_bytes, recompute=True):
  """The most Transformer layers (the paper's Table 1 model) whose
  predicted peak fits `memory_bytes` on every one of `num_stages` devices,
  over M in the divisors of the batch; (layers, M, peak bytes)."""
  layers, shapes = PaperTransformer(2)
  profile = planner.ProfileLayers(layers, shapes, name='transformer')
  first, block, last = profile.layers[0], profile.layers[1], profile.layers[-1]
  ms = [1] if not recompute else [1, 2, 4, 8, 16, 32]

  def Peak(num_blocks, m):
    prof = planner.ModelProfile(
      'transformer', [first] + [block] * num_blocks + [last], PAPER_BATCH
    )
    base, extra = divmod(num_blocks, num_stages)
    splits, end = [], 1
    for k in range(num_stages):
      end += base + (1 if k < extra else 0)
      splits.append(end)
    splits[-1] += 1  # the loss layer joins the last cell
    cells = planner.CellCosts(prof, splits, m, 1, device)
    return max(cost_model.PeakMemoryBytes(c, m, recompute, 2) for c in cells)

  best = (0, None, None)
  for m in ms:
    lo, hi = 0, num_stages
    if Peak(max(hi, 1), m) > memory_bytes:
      hi = 0
    else:
      while Peak(hi * 2, m) <= memory_bytes:
        hi *= 2
      lo, hi = hi, hi * 2
      while hi - lo > 1:
        mid = (lo + hi) // 2
        if Peak(mid, m) <= memory_bytes:
          lo = mid
        else:
          hi = mid
      hi = lo
    if hi > best[0]:
      best = (hi, m, Peak(hi, m))
  return best


def PaperTable1(args):
  device = device_presets.GetPreset(args.paper_device)
  memory = ParseBytes(args.memory_per_device) or 16 * GIB
  records = []
  rows = [('naive-1', 1, False, PAPER_TABLE1_NAIVE)] + [
    (f'pipeline-{k}', k, True, n) for k, n in PAPER_TABLE1_TRANSFORMER.items()
  ]
  for label, k, rc, paper in rows:
    n, m, peak = LargestTransformer(device, k, memory, recompute=rc)
    records.append(
      dict(
        config=label,
        num_stages=k,
        num_micro_batches=m,
        predicted_layers=n,
        paper_layers=paper,
        ratio=n / paper,
        peak_bytes_per_device=peak,
      )
    )
  print(
    f"The paper's Table 1 (largest Transformer, {planner.FormatBytes(memory)}"
    f' per {device.name}):'
  )
  print(f'{"config":>13} {"M":>3} {"predicted":>9} {"paper":>6} {"ratio":>6}')
  for r in records:
    print(
      f'{r["config"]:>13} {r["num_micro_batches"] or "-":>3} '
      f'{r["predicted_layers"]:>9} {r["paper_layers"]:>6} {r["ratio"]:>6.2f}'
    )
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(records, f, indent=1)
    print(f'Wrote {args.json}')
  return records
