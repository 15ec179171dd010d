"""Tasks built from lingvo_gpipe layers, e.g. classifier.ClassifierTask."""
