"""Language-model experiments (Lingvo's GPipe Transformer LM)."""
