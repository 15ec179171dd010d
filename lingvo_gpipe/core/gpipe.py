"""GPipe pipeline parallelism: Lingvo's import path for the pipeline.

The implementation lives in `lingvo_gpipe.pipeline`; this module re-exports
its public surface under the name Lingvo users know
(`from lingvo.core import gpipe` -> `from lingvo_gpipe.core import gpipe`):
`PipeliningLayer` (Lingvo's Params, `before_tpl` included), `SeqLayer`,
`FeatureExtractionLayer` and Lingvo's `PartitionSequentialLayers`.
"""

from lingvo_gpipe.gpipe_layers.seq_layer import PartitionSequentialLayers
from lingvo_gpipe.gpipe_layers.seq_layer import SeqLayer
from lingvo_gpipe.pipeline.pipelining_layer import FeatureExtractionLayer
from lingvo_gpipe.pipeline.pipelining_layer import PipeliningLayer
from lingvo_gpipe.pipeline.pipelining_layer import RECOMPUTE_POLICIES
from lingvo_gpipe.pipeline.pipelining_layer import SCHEDULES
from lingvo_gpipe.pipeline.schedule import BubbleFraction
from lingvo_gpipe.pipeline.schedule import IdealSpeedup
from lingvo_gpipe.pipeline.schedule import ScheduleText
from lingvo_gpipe.pipeline.schedule import ScheduleTracer
from lingvo_gpipe.planning.balance import BalancedSplits
from lingvo_gpipe.planning.balance import MakeReport
from lingvo_gpipe.planning.balance import PartitionReport
from lingvo_gpipe.planning.balance import UniformSplits
from lingvo_gpipe.planning.partition import ComputeSplits
from lingvo_gpipe.planning.partition import LayerCosts
from lingvo_gpipe.planning.partition import Report

__all__ = [
  'BalancedSplits',
  'BubbleFraction',
  'ComputeSplits',
  'FeatureExtractionLayer',
  'IdealSpeedup',
  'LayerCosts',
  'MakeReport',
  'PartitionReport',
  'PartitionSequentialLayers',
  'PipeliningLayer',
  'RECOMPUTE_POLICIES',
  'Report',
  'SCHEDULES',
  'SeqLayer',
  'ScheduleText',
  'ScheduleTracer',
  'UniformSplits',
]
