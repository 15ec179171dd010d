"""The command-line tools, installed as console scripts (setup.py).

`python tools/<name>.py` in a checkout runs the same code."""
