"""lingvo_gpipe/tools/common.py: the tools' one error type, table printer
and benchmark models."""

import argparse
import subprocess
import sys

import pytest

from lingvo_gpipe.tools import build_cost
from lingvo_gpipe.tools import common
from lingvo_gpipe.tools import max_model_size
from lingvo_gpipe.tools import plan


def testMainPrintsAUserErrorAsOneLineAndExitsWith2(capsys):
  def Run(argv):
    if argv:
      raise common.UserError(f'--x={argv[0]!r}: use 1 or 2.')
    return 0

  assert common.Main('tool', Run, []) == 0
  assert common.Main('tool', Run, ['3']) == 2
  assert capsys.readouterr().err == "tool: error: --x='3': use 1 or 2.\n"


def testEveryToolReportsBadInputTheSameWay(capsys):
  assert plan.UserError is common.UserError
  for main, argv, prog in (
    (plan.main, ['--model=bench.resnet'], 'plan'),
    (build_cost.main, ['--configs=resnet:L=2:K=2:M=2'], 'build_cost'),
    (max_model_size.main, ['--family=resnet'], 'max_model_size'),
  ):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f'{prog}: error: '), err


def testFormatTableAlignsColumnsUnderARule():
  text = common.FormatTable(['name', 'n'], [['a', '100'], ['bbbbbb', '2']])
  assert text.splitlines() == [
    '  name    n',
    '-----------',
    '     a  100',
    'bbbbbb    2',
  ]
  assert common.FormatTable(['x'], []) == 'x\n-'


@pytest.mark.parametrize('name', sorted(common.MODELS))
def testBenchmarkModelsComeFromTheSharedFlags(name):
  parser = argparse.ArgumentParser()
  common.AddModelArgs(parser)
  args = parser.parse_args(['--num_blocks=3', '--dim=64', '--batch_size=4'])
  layers, shape = common.MODELS[name](args)
  assert layers and shape[0] in (4, 4 * args.seq_len)


def testImportingItLeavesTensorFlowOut():
  code = (
    'import sys; import lingvo_gpipe.tools.common; '
    "print('tensorflow' in sys.modules)"
  )
  out = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, check=True
  )
  assert out.stdout.strip() == 'False'
