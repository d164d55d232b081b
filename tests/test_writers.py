"""A run's writers (metrics.jsonl, TensorBoard, checkpoints) are closed on every way
out. A full disk ends `jaxformer train` with its one error line and nothing after it:
no TensorBoard writer thread or exit hook is left to hit the disk once more."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The disk fills when step 2's record is written: metrics.jsonl and every TensorBoard
# write, flush or close from then on fail with ENOSPC, as on a full tmpfs. The script
# then reports whether each event file and the checkpoint saver were closed.
FULL_DISK = """
import errno, json, sys
import tensorboardX.record_writer as rw
from jaxformer.checkpoints import saver
from jaxformer.cli.main import main
from jaxformer.observe import run_log, tb

full, closed = [], {"events": [], "saver": 0}

def no_space():
    raise OSError(errno.ENOSPC, "No space left on device")

def write_record(path, record, real=run_log.write_record):
    if record["step"] >= 2:
        full.append(True)
    if full:
        no_space()
    real(path, record)

def failing(name):
    real = getattr(rw.RecordWriter, name)
    def call(self, *args):
        if name == "close":
            real(self)  # the last flush is what fails; the file is closed all the same
        if full:
            no_space()
        if name != "close":
            return real(self, *args)
    return call

def tracked(key, real_close):
    def close(self):
        try:
            return real_close(self)
        finally:
            if key == "saver":
                closed["saver"] += 1
            else:
                closed["events"].append(self)
    return close

run_log.write_record = write_record
for name in ("write", "flush", "close"):
    setattr(rw.RecordWriter, name, failing(name))
tb.EventLog.close = tracked("events", tb.EventLog.close)
saver.Saver.close = tracked("saver", saver.Saver.close)
code = main(sys.argv[1:])
print(json.dumps({"code": code, "saver_closed": closed["saver"],
                  "events_closed": [getattr(e, "closed", None) for e in closed["events"]]}))
sys.exit(code)
"""


def test_a_full_disk_ends_with_one_error_line_and_every_writer_closed(corpus, tmp_path):
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--corpus", corpus, "--steps", "4", "--out", str(out),
            "--log-every", "1", "--eval-every", "0", "--ckpt-every", "1", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, *argv], capture_output=True, text=True,
                          env=env, timeout=300)
    err = proc.stderr
    assert proc.returncode == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert errors == ["error: [Errno 28] No space left on device"], err[-3000:]
    assert lines[-1] == errors[0], err[-3000:]  # nothing printed after the error line
    assert "Traceback" not in err and "Exception" not in err, err[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["code"] == 2
    assert report["events_closed"] == [True], report  # the TensorBoard file, closed once
    assert report["saver_closed"] >= 1, report  # the checkpoints: the save in flight finished
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
