"""lingvo_gpipe: GPipe pipeline parallelism for TensorFlow 2, Lingvo style."""

import setuptools

# TensorFlow comes as an extra so that CPU-only and GPU machines pick their
# build: `pip install -e ".[cpu]"` or `pip install -e ".[gpu]"`.
TF_VERSION = '2.21.0'
DOCS = ['mkdocs>=1.6,<2', 'mkdocstrings[python]>=1.0']

setuptools.setup(
  name='lingvo_gpipe',
  version='0.1.0',
  description=(
    'GPipe pipeline parallelism for TensorFlow 2 with Lingvo-style '
    'Params, layers, model registry and trainer.'
  ),
  long_description=open('README.md', encoding='utf-8').read(),
  long_description_content_type='text/markdown',
  python_requires='>=3.11',
  # Every folder under params/ is installed, with an __init__.py or without
  # (a namespace package), so a new topic folder needs no edit here.
  packages=(
    setuptools.find_packages(include=['lingvo_gpipe', 'lingvo_gpipe.*'])
    + setuptools.find_namespace_packages(
      include=['params', 'params.*'], exclude=['*.__pycache__']
    )
  ),
  install_requires=[
    'numpy>=1.26',
    'absl-py>=2.1',
    'scikit-learn>=1.4',  # ships the handwritten digits used offline
    'matplotlib>=3.8',  # pipeline timeline charts
    'sentencepiece>=0.2',  # shared multilingual subword vocabulary
    'sacrebleu>=2.4',  # BLEU
    'num2words>=0.5.13',  # the offline multilingual demo corpus
  ],
  extras_require={
    'cpu': [f'tensorflow-cpu=={TF_VERSION}'],
    'gpu': [f'tensorflow[and-cuda]=={TF_VERSION}'],
    # The documentation site (mkdocs.yml): `mkdocs build --strict`.
    'docs': DOCS,
    # The tests build the site too (tests/docs_test.py).
    'test': ['pytest>=8', 'pytest-xdist>=3.5', 'sympy>=1.12', 'ruff==0.17.6']
    + DOCS,
  },
  entry_points={
    'console_scripts': [
      'gpipe_trainer=lingvo_gpipe.trainer:main',
      'gpipe_tf_server=lingvo_gpipe.runners.tf_server:main',
      # The tools (also `python tools/<name>.py` in a checkout).
      'lingvo-gpipe-plan=lingvo_gpipe.tools.plan:main',
      'lingvo-gpipe-inspect=lingvo_gpipe.tools.inspect_model:main',
      'lingvo-gpipe-capacity=lingvo_gpipe.tools.max_model_size:main',
      'lingvo-gpipe-bench=lingvo_gpipe.tools.benchmark_pipeline:RunAndExit',
      'lingvo-gpipe-build-cost=lingvo_gpipe.tools.build_cost:main',
      'lingvo-gpipe-accelerator-check=lingvo_gpipe.tools.accelerator_check:main',
    ],
  },
)
