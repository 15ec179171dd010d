"""Experiment configurations, registered in `lingvo_gpipe.model_registry`.

A module `params/<area>/<name>.py` registers classes under the key
`<area>.<name>.<ClassName>`, e.g. `image.digits.MlpDigitsTiny`.
"""
