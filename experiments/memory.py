"""Memory of the lean manual backward (blockwise attention, chunked loss, block recompute)
against jax.value_and_grad of the plain model, and its step time against the full manual
backward; XLA's memory plan of each compiled gradient (jaxformer/memory.py).

    python experiments/memory.py                        # B 4, T 1024 and 2048, D 256, 4 heads, 2 layers
    python experiments/memory.py --attention-block 256 --loss-chunk 512 --no-timing

Prints, from one run:
    (a) temp(lean manual) / temp(autodiff) at T            target <= 1/4
    (b) temp at 2T / temp at T for each source             blockwise and lean: target <= 2.2
    (c) step time, lean manual / full manual at T          target <= 1.3 (interleaved rounds,
                                                           warm-up excluded, medians)
"""

from __future__ import annotations

import argparse

from jaxformer.tools import memory


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024, help="T; (b) also compiles at 2T")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--n-layers", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--attention-block", type=int, default=128, help="query and key block size")
    parser.add_argument("--loss-chunk", type=int, default=256, help="positions per chunk of the loss")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up)")
    parser.add_argument("--no-timing", dest="timing", action="store_false", help="memory only")
    args = parser.parse_args(argv)
    if min(args.batch_size, args.seq_len, args.rounds, args.loss_chunk) <= 0:
        parser.error("--batch-size, --seq-len, --rounds and --loss-chunk must be positive")
    try:
        config = memory.memory_config(args.seq_len, args.d_model, args.n_heads, args.n_layers,
                                      args.vocab_size, args.attention_block)
    except ValueError as e:
        parser.error(str(e))
    print(f"B={args.batch_size} D={args.d_model} H={args.n_heads} L={args.n_layers} "
          f"V={args.vocab_size}, float32; blockwise block {args.attention_block}, "
          f"loss chunk {args.loss_chunk}")
    report = memory.memory_report(config, args.batch_size, args.seq_len, 2 * args.seq_len,
                                  args.loss_chunk, rounds=args.rounds, timing=args.timing)
    print(memory.format_report(report, args.seq_len, 2 * args.seq_len))


if __name__ == "__main__":
    main()
