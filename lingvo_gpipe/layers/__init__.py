"""Core layers (Lingvo names). Import a module, or the classes from here."""

from lingvo_gpipe.layers.activations import ActivationLayer
from lingvo_gpipe.layers.attention import MultiHeadedAttention
from lingvo_gpipe.layers.attention import MultiHeadedProjectionLayer
from lingvo_gpipe.layers.convolutions import Conv2DLayer
from lingvo_gpipe.layers.convolutions import DepthwiseConv2DLayer
from lingvo_gpipe.layers.convolutions import SeparableConv2DLayer
from lingvo_gpipe.layers.dropout import DeterministicDropoutLayer
from lingvo_gpipe.layers.dropout import DropoutLayer
from lingvo_gpipe.layers.embedding import PositionalEmbeddingLayer
from lingvo_gpipe.layers.embedding import SimpleEmbeddingLayer
from lingvo_gpipe.layers.linears import BiasLayer
from lingvo_gpipe.layers.linears import FCLayer
from lingvo_gpipe.layers.linears import GluLayer
from lingvo_gpipe.layers.linears import ProjectionLayer
from lingvo_gpipe.layers.normalizations import BatchNormLayer
from lingvo_gpipe.layers.normalizations import LayerNorm
from lingvo_gpipe.layers.pooling import GlobalPoolingLayer
from lingvo_gpipe.layers.pooling import PoolingLayer
from lingvo_gpipe.layers.reshape import FlattenLayer
from lingvo_gpipe.layers.sequential import FetchLayer
from lingvo_gpipe.layers.sequential import RepeatLayer
from lingvo_gpipe.layers.sequential import SequentialLayer
from lingvo_gpipe.layers.softmax import SimpleFullSoftmax
from lingvo_gpipe.layers.softmax import SoftmaxCrossEntropyWithLabelSmoothing
from lingvo_gpipe.layers.softmax import UniformLabelSmoother
from lingvo_gpipe.layers.transformer import TransformerAttentionLayer
from lingvo_gpipe.layers.transformer import TransformerFeedForwardLayer
from lingvo_gpipe.layers.transformer import TransformerLayer

__all__ = [
  'ActivationLayer',
  'BatchNormLayer',
  'BiasLayer',
  'Conv2DLayer',
  'DepthwiseConv2DLayer',
  'DeterministicDropoutLayer',
  'DropoutLayer',
  'FCLayer',
  'FetchLayer',
  'FlattenLayer',
  'GlobalPoolingLayer',
  'GluLayer',
  'LayerNorm',
  'MultiHeadedAttention',
  'MultiHeadedProjectionLayer',
  'PoolingLayer',
  'PositionalEmbeddingLayer',
  'ProjectionLayer',
  'RepeatLayer',
  'SeparableConv2DLayer',
  'SequentialLayer',
  'SimpleEmbeddingLayer',
  'SimpleFullSoftmax',
  'SoftmaxCrossEntropyWithLabelSmoothing',
  'TransformerAttentionLayer',
  'TransformerFeedForwardLayer',
  'TransformerLayer',
  'UniformLabelSmoother',
]
