"""Layers built on the pipeline: Lingvo's GPipe Transformer stacks
(`layers_with_gpipe`, `batch_major_gpipe`, `evolved_gpipe`), `SeqLayer`, and
a Keras model pipelined (`keras_model`)."""
