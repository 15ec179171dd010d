"""Input generators of public data sets (see core/base_input_generator)."""
