"""Lingvo's import path of the GPipe Transformer.

Re-exports `lingvo_gpipe.gpipe_layers.layers_with_gpipe`
(`from lingvo.core import layers_with_gpipe` ->
`from lingvo_gpipe.core import layers_with_gpipe`), with the batch-major
stack of `batch_major_gpipe` and the Evolved Transformer of `evolved_gpipe`.
"""

from lingvo_gpipe.gpipe_layers.batch_major_gpipe import (
  GPipeBatchMajorTransformerEmbeddingLayer,
)
from lingvo_gpipe.gpipe_layers.batch_major_gpipe import (
  GPipeBatchMajorTransformerSoftmaxLayer,
)
from lingvo_gpipe.gpipe_layers.batch_major_gpipe import (
  GPipeBatchMajorTransformerStack,
)
from lingvo_gpipe.gpipe_layers.evolved_gpipe import (
  GPipeEvolvedTransformerDecoderLayer,
)
from lingvo_gpipe.gpipe_layers.evolved_gpipe import (
  GPipeEvolvedTransformerEncoderLayer,
)
from lingvo_gpipe.gpipe_layers.evolved_gpipe import GPipeEvolvedTransformerStack
from lingvo_gpipe.gpipe_layers.layers_with_gpipe import (
  DeterministicWeightsLayer,
)
from lingvo_gpipe.gpipe_layers.layers_with_gpipe import (
  GPipeTransformerEmbeddingLayer,
)
from lingvo_gpipe.gpipe_layers.layers_with_gpipe import GPipeTransformerLayer
from lingvo_gpipe.gpipe_layers.layers_with_gpipe import (
  GPipeTransformerSoftmaxLayer,
)
from lingvo_gpipe.gpipe_layers.layers_with_gpipe import GPipeTransformerStack

__all__ = [
  'DeterministicWeightsLayer',
  'GPipeBatchMajorTransformerEmbeddingLayer',
  'GPipeBatchMajorTransformerSoftmaxLayer',
  'GPipeBatchMajorTransformerStack',
  'GPipeEvolvedTransformerDecoderLayer',
  'GPipeEvolvedTransformerEncoderLayer',
  'GPipeEvolvedTransformerStack',
  'GPipeTransformerEmbeddingLayer',
  'GPipeTransformerLayer',
  'GPipeTransformerSoftmaxLayer',
  'GPipeTransformerStack',
]
