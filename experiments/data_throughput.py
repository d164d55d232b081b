"""Data throughput: ``jaxformer prepare`` on the whole stdlib corpus, the memory-mapped
batcher on a >= 1 GB synthetic shard set at gpt2's 8 x 1024, and the peak RSS of a
training process (tiny model) over 100 MB and 1 GB of shards. Prints one line per
figure with the machine's load (``uptime``); generated data goes under /tmp and is
deleted at the end.

    PYTHONPATH=. python experiments/data_throughput.py [--skip-prepare] [--skip-rss] [--gb 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxformer import data
from jaxformer.data import shards
from jaxformer.data.prepare import prepare
from jaxformer.data.sources import total_bytes


def say(line: str) -> None:
    print(f"{line}  [load {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f} {os.getloadavg()[2]:.1f}, "
          f"{os.cpu_count()} cores]", flush=True)


def prepare_throughput(tmp: Path) -> None:
    """prepare on the whole stdlib: byte, and a 8192-token BPE given as a tokenizer.json
    (learned first, outside the timing)."""
    n_bytes = total_bytes("stdlib")
    bpe = data.make_tokenizer("bpe", vocab_size=8192,
                              texts=(p.data.decode("utf-8", "replace") for p in data_pieces()))
    bpe.tokenizer.save(str(tmp / "bpe8192.json"))
    for kind in ("byte", str(tmp / "bpe8192.json")):
        out = tmp / f"prep-{Path(kind).stem}"
        t0 = time.perf_counter()
        meta = prepare("stdlib", kind, out, progress=False)
        dt = time.perf_counter() - t0
        tokens = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
        say(f"prepare stdlib ({n_bytes / 1e6:.1f} MB) tokenizer {Path(kind).name}: {dt:.1f} s, "
            f"{n_bytes / 1e6 / dt:.2f} MB/s of text, {tokens / dt:,.0f} tokens/s")
        shutil.rmtree(out)


def data_pieces():
    from jaxformer.data.sources import pieces
    return pieces("stdlib")


def synthetic(out: Path, n_bytes: int, shard_bytes: int = 128 << 20, vocab: int = 256) -> Path:
    """A prepared folder of random uint16 byte-tokenizer ids (train only), n_bytes in all."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    entries, left, k = [], n_bytes, 0
    while left > 0:
        n = min(shard_bytes, left) // 2
        ids = rng.integers(0, vocab, n, dtype=np.uint16)
        name = shards.shard_name("train", k)
        ids.tofile(out / name)
        entries.append({"file": name, "tokens": int(n), "sha256": "synthetic"})
        left, k = left - 2 * n, k + 1
    tok = data.ByteTokenizer().to_dict()
    meta = {"format": shards.FORMAT, "version": 1, "dtype": "uint16", "vocab_size": 256, "tokenizer": tok,
            "source": {"corpus": "synthetic"}, "documents": 0, "bytes": n_bytes,
            "splits": {"train": {"tokens": sum(e["tokens"] for e in entries), "shards": entries},
                       "val": {"tokens": 0, "shards": []}}}
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def batcher_throughput(folder: Path, n: int = 400) -> None:
    meta = shards.read_meta(folder)
    tokens = data.open_split(folder, meta, "train")
    batcher = data.Batcher(tokens, 8, 1024, seed=0)
    batcher.batch(0)  # the epoch's permutation, once
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        batcher.batch(i * 997)  # scattered over the epoch: mostly pages not yet read
    dt = time.perf_counter() - t0
    say(f"batcher over {len(tokens) * 2 / 1e9:.2f} GB of memory-mapped uint16 shards, 8 x 1024: "
        f"{n / dt:,.0f} batches/s ({dt / n * 1e3:.2f} ms a batch)")


def peak_rss(folder: Path, tmp: Path, steps: int = 30) -> None:
    """The peak RSS of a `jaxformer train --data` process (tiny model)."""
    out = tmp / f"run-{folder.name}"
    cmd = [sys.executable, "-m", "jaxformer", "train", "--preset", "tiny", "--data", str(folder),
           "--steps", str(steps), "--out", str(out), "--no-progress", "--ckpt-every", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    err = proc.stderr.read().decode()
    if status:
        raise SystemExit(f"training failed: {err[-2000:]}")
    size = sum(s["tokens"] for s in shards.read_meta(folder)["splits"]["train"]["shards"]) * 2
    say(f"peak RSS of `jaxformer train --preset tiny --data` ({steps} steps) over {size / 1e6:,.0f} MB "
        f"of shards: {usage.ru_maxrss / 1024:,.0f} MiB")
    shutil.rmtree(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-prepare", action="store_true")
    p.add_argument("--skip-rss", action="store_true")
    p.add_argument("--gb", type=float, default=1.0, help="size of the large synthetic shard set")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="jaxformer-data-", dir="/tmp"))
    try:
        print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
        if not args.skip_prepare:
            prepare_throughput(tmp)
        big = synthetic(tmp / "big", int(args.gb * 1e9))
        batcher_throughput(big)
        if not args.skip_rss:
            small = synthetic(tmp / "small", int(100e6))
            peak_rss(small, tmp)
            peak_rss(big, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
