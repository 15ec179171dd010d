"""tools/local_cluster.py starts workers a trainer can use; the benchmark's
data-parallel rows report the bytes the workers exchange."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from lingvo_gpipe.tools import benchmark_pipeline
from tests.testing import trainer_process
from tests.testing import warm_python

ROOT = pathlib.Path(__file__).resolve().parents[2]


def testLauncherServesATrainerAndStops(tmp_path):
  spec_file = tmp_path / 'spec.json'
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=str(ROOT))
  proc = subprocess.Popen(
    [
      sys.executable,
      str(ROOT / 'tools' / 'local_cluster.py'),
      '--num_workers=2',
      f'--spec_file={spec_file}',
      '--serve_seconds=300',
    ],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    deadline = time.time() + 120
    while not spec_file.exists() and time.time() < deadline:
      assert proc.poll() is None, proc.stderr.read()[-3000:]
      time.sleep(0.2)
    spec = json.loads(spec_file.read_text())
    assert len(spec['worker']) == 2
    logdir = tmp_path / 'logdir'
    res = trainer_process.Run(
      f'--logdir={logdir}',
      '--cluster_spec=' + json.dumps(spec),
      '--worker_split_size=2',
      '--max_steps=3',
    )
    assert res.returncode == 0, res.stderr[-3000:]
    placement = (logdir / 'placement.txt').read_text()
    assert 'cell 1 on /job:worker/replica:0/task:1/device:CPU:0' in placement
    # The same cluster through TF_CONFIG; the trainer resumes to step 5.
    env = trainer_process.Env()
    env['TF_CONFIG'] = json.dumps(
      {'cluster': spec, 'task': {'type': 'chief', 'index': 0}}
    )
    res = warm_python.Run(
      trainer_process.Cmd(
        f'--logdir={logdir}', '--worker_split_size=2', '--max_steps=5'
      ),
      cwd=ROOT,
      env=env,
      timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "remote job 'worker'" in res.stderr
    assert trainer_process.Latest(logdir / 'train') == 5
  finally:
    proc.terminate()
    out, err = proc.communicate(timeout=60)
  assert proc.returncode == 0, err[-3000:]
  assert 'workers ready' in out and '--cluster_spec=worker=127.0.0.1:' in out
  assert 'Cluster stopped.' in out


@pytest.mark.slow
def testADeadWorkerIsRestartedOnItsOwnPort(tmp_path):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=str(ROOT))
  proc = subprocess.Popen(
    [
      sys.executable,
      str(ROOT / 'tools' / 'local_cluster.py'),
      '--num_workers=2',
      '--serve_seconds=300',
    ],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    lines = []
    while not any('lingvo_gpipe.trainer' in ln for ln in lines):
      line = proc.stdout.readline()
      assert line, proc.stderr.read()[-3000:]
      lines.append(line)
    pids = [
      int(ln.split('pid ')[1].split(',')[0]) for ln in lines if 'pid' in ln
    ]
    spec = [ln for ln in lines if 'workers ready' in ln][0]
    os.kill(pids[1], signal.SIGKILL)
    restarted = proc.stdout.readline()
    assert 'Worker 1 exited; restarting it on 127.0.0.1:' in restarted
    assert restarted.split(' on ')[1].split()[0] in spec  # Its own port.
    ready = proc.stdout.readline()
    assert 'task 1: pid' in ready and 'the cluster spec is unchanged' in ready
    new_pid = int(ready.split('pid ')[1].split()[0])
    assert new_pid != pids[1]
    os.kill(pids[0], 0)  # Worker 0 kept running.
    os.kill(new_pid, 0)
  finally:
    proc.terminate()
    out, err = proc.communicate(timeout=60)
  assert proc.returncode == 0, err[-3000:]
  assert 'Cluster stopped.' in out


def testBenchmarkReportsBytesBetweenAndPeakBytesPerWorker(tmp_path):
  # One run of worker processes: data-parallel and pipelined rows, with the
  # bytes between workers and each worker's peak.
  out_json = tmp_path / 'bench.json'
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=str(ROOT))
  res = warm_python.Run(
    [
      sys.executable,
      str(ROOT / 'tools' / 'benchmark_pipeline.py'),
      '--mode=multi_process',
      '--model=mlp',
      '--configs=0x1x0,1x1x0x2,2x2x1',
      '--batch_size=64',
      '--dim=64',
      '--num_blocks=4',
      '--steps=1',
      '--warmup=1',
      '--progress_every_s=0',
      '--memory=1',
      f'--json={out_json}',
    ],
    env=env,
    timeout=300,
  )
  assert res.returncode == 0, res.stderr[-3000:]
  records = json.loads(out_json.read_text())['records']
  by = {(r['num_stages'], r['replicas']): r for r in records}
  assert set(by) == {(0, 1), (1, 2), (2, 1)}
  # One worker: at most a few control messages (keep-alives) between them.
  assert by[(0, 1)]['bytes_between_workers_per_step'] < 4096
  # Replicas exchange weights and gradients; stages exchange activations.
  weights = by[(1, 2)]['weight_bytes']
  assert by[(1, 2)]['bytes_between_workers_per_step'] >= 2 * weights
  assert by[(2, 1)]['bytes_between_workers_per_step'] > 0
  assert 'bytes_between_workers_per_step' in res.stdout
  # Progress on stderr, each phase and every step; stdout is the table.
  for line in (
    'mlp: building the configurations',
    'mlp: compiling and warming up 3 configurations (1 steps each)',
    'mlp: warm-up K=1 M=1 R=2: step 1/1 (configuration 2/3)',
    'mlp: timing 1 rounds of 3 configurations',
    'mlp: plain: step 1/1',
    'mlp: K=2 M=2 recompute: step 1/1',
  ):
    assert line in res.stderr, (line, res.stderr[-3000:])
  assert res.stdout.splitlines()[0].split()[:2] == ['model', 'mode']
  assert 'step 1/1' not in res.stdout
  # The functions were freed while the workers still ran: no error at exit.
  assert 'Failed to remove function remotely' not in res.stderr, res.stderr
  # Peak bytes: the plain model lives on worker 0 alone; the pipeline on
  # both workers.
  plain, piped = by[(0, 1)]['peak_bytes'], by[(2, 1)]['peak_bytes']
  assert len(plain) == 1 and len(piped) == 2
  assert all(v > 0 for v in piped.values())
  assert min(by[(2, 1)]['activation_bytes'].values()) > 0
  assert "each worker process's allocator" in res.stdout


def testBenchmarkSchedulesRecordsAndTimelines(tmp_path, capsys):
  out_json = tmp_path / 'bench.json'
  trace_dir = tmp_path / 'trace'
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=str(ROOT))
  cmd = [
    sys.executable,
    str(ROOT / 'tools' / 'benchmark_pipeline.py'),
    '--mode=in_process',
    '--model=mlp',
    '--configs=0x1x0,2x4x1',
    '--schedules=gpipe,1f1b,interleaved',
    '--batch_size=16',
    '--dim=16',
    '--num_blocks=4',
    '--steps=1',
    '--warmup=1',
    f'--trace={trace_dir}',
    '--trace_micro_batches=4',
    f'--json={out_json}',
  ]
  res = warm_python.Run(cmd, env=env, timeout=300)
  assert res.returncode == 0, res.stderr[-3000:]
  result = json.loads(out_json.read_text())
  rows = {(r['schedule'], r['num_cells']): r for r in result['records']}
  assert set(rows) == {(None, 0), ('gpipe', 2), ('1f1b', 2), ('interleaved', 4)}
  assert rows[('interleaved', 4)]['num_stages'] == 2  # 4 cells, 2 devices
  assert rows[('interleaved', 4)]['ideal_speedup'] == pytest.approx(16 / 9)
  pngs = {name: t['png'] for name, t in result['trace'].items()}
  assert sorted(pngs) == ['1f1b', 'gpipe', 'interleaved']
  assert len(set(pngs.values())) == 3
  assert all(os.path.getsize(p) > 0 for p in pngs.values())
  # The interleaved timeline has a row per cell: 4 cells on 2 devices.
  assert len(result['trace']['interleaved']['utilization']) == 4
  assert 'schedule' in res.stdout.splitlines()[0]
  with pytest.raises(SystemExit) as bad:
    benchmark_pipeline.main(['--schedules=gpipe,zigzag'])
  assert bad.value.code == 2
  assert 'use a comma list of gpipe, 1f1b, interleaved' in (
    capsys.readouterr().err
  )
