"""Machine translation experiments (the GPipe paper's multilingual models)."""
