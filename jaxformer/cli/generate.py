"""``jaxformer generate``: sample text from a run's checkpoint, or from an imported model
(``--init-from`` a Hugging Face folder, a hub id or a GGUF file) with its own tokenizer;
``--chat`` renders the chat template of the model (or the one the run was trained with) and
streams the reply until an end-of-turn id. stderr says what is loaded and compiled, and
ends with one timing line."""

from __future__ import annotations

import argparse
import sys

import jax

from jaxformer.checkpoints import checkpoint
from jaxformer.cli.args import UsageError, nonneg_int, positive_int
from jaxformer.cli.flags import add_model_flags, flag_name, model_overrides
from jaxformer.data import tokenizer_from_dict
from jaxformer.inference.mesh import model_mesh, split_model
from jaxformer.inference.stream import load_model, render_chat, stream_text, stream_tokens
from jaxformer.inference.text import load_run_model, run_chat, sample_texts
from jaxformer.model.config import HOW_FIELDS

EPILOG = """\
examples:
  jaxformer generate --run runs/loopos --prompt "Once upon a time" --max-new-tokens 200
  jaxformer generate --run runs/loopos --prompt "The " --temperature 0      (greedy)
  jaxformer generate --run runs/loopos --prompt "The " --temperature 0.8 --top-k 20 --seed 3
  jaxformer generate --run runs/loopos --prompt "The " --top-p 0.9 --num-samples 3
  jaxformer generate --run runs/lora --chat "What is the capital of France?"
  jaxformer generate --init-from SmolLM2-135M-Instruct.Q4_1.gguf --chat "What is the capital of France?"
  jaxformer generate --init-from ./llama-folder --prompt "The capital of Germany is" --temperature 0
  jaxformer generate --run runs/big --prompt "The " --mesh tensor=4      (the model split over 4 devices)

--init-from samples from a model folder, a hub id or a .gguf file without a training
run, with the model's own tokenizer; the text streams as it comes and stops at the
model's end-of-turn ids. --chat renders a chat template for one user turn (greedy unless
--temperature is given) and streams the reply until an end-of-turn id: the model's own
with --init-from; with --run, the template and stop ids the run was trained with (a LoRA
run's frozen base, the model whose tokenizer it reads, or its chat data), a LoRA run's
adapters merged into its base.

Sampling uses a key/value cache of the prompt and the new tokens (at most max_seq_len
slots): one prefill of the prompt's last max_seq_len tokens, then one cached step per
token. When the cache is full the context restarts as its last max_seq_len // 2 tokens
(positions stay within the trained table). --no-cache runs the whole sliding window per
token instead. stderr says what is loaded and compiled, then one timing line: the
prefill's and the decode's tokens per second, the compile apart.
"""

# ModelConfig fields generate may change: how the model computes, not what (dropout aside:
# sampling never drops).
MODEL_FLAGS = tuple(name for name in HOW_FIELDS if name != "dropout")


def add_parser(subparsers) -> argparse.ArgumentParser:
    g = subparsers.add_parser("generate", help="sample text or chat with a trained run or an imported model",
                              description="Sample text from a run's latest checkpoint or an imported model, "
                                          "or chat with either.", epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    source = g.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="DIR", help="run folder written by `jaxformer train`")
    source.add_argument("--init-from", metavar="SOURCE",
                        help="a Hugging Face model folder or hub id, or a .gguf file: sample from it")
    text = g.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="text to continue")
    text.add_argument("--chat", metavar="MESSAGE", nargs="?", const="",
                      help="a user message, in the chat template of the model or of the run; with no "
                           "message, a conversation: one user turn per line of stdin")
    g.add_argument("--max-new-tokens", type=nonneg_int, default=200, metavar="N", help="default 200")
    g.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="0: greedy (default 0.8; 0 with --chat)")
    g.add_argument("--top-k", type=nonneg_int, default=0, metavar="K", help="sample among the K likeliest (0: all)")
    g.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample among the likeliest tokens whose probability sums to P, in (0, 1] (default 1: all)")
    g.add_argument("--num-samples", type=positive_int, default=1, metavar="N",
                   help="continuations of the prompt, sampled side by side (default 1)")
    g.add_argument("--no-cache", action="store_true",
                   help="run the whole window per token instead of the key/value cache (the reference)")
    g.add_argument("--seed", type=nonneg_int, default=0)
    g.add_argument("--step", type=nonneg_int, metavar="N", help="use the checkpoint of step N (default: latest)")
    g.add_argument("--mesh", metavar="TEXT",
                   help="split the model over devices, e.g. tensor=4 (heads, MLP, vocabulary and the "
                        "key/value cache) or fsdp=2,tensor=2; default: one device")
    add_model_flags(g, title="model computation (the shape comes from the checkpoint)",
                    shown=MODEL_FLAGS, default_from="the checkpoint's")
    return g


def run(args: argparse.Namespace) -> int:
    overrides = model_overrides(args)
    shape = sorted(set(overrides) - set(MODEL_FLAGS))
    if shape:
        raise UsageError(f"generate takes the model's shape from the checkpoint; "
                         f"{', '.join(flag_name(n) for n in shape)} cannot change it")
    mesh = devices_mesh(args)
    if args.init_from:
        return run_imported(args, overrides, mesh)
    if args.chat is not None:
        one_stream(args, "--chat")
    meta = checkpoint.read_meta(args.run, args.step) if args.step is not None \
        else checkpoint.newest_meta(args.run)
    if meta.get("param_dtype") == "float64":
        jax.config.update("jax_enable_x64", True)
    chat = None
    if args.chat is not None:  # before the load: a run without a template is refused at once
        try:
            chat, where = run_chat(meta, tokenizer_from_dict(meta["tokenizer"]))
        except (KeyError, TypeError) as e:
            raise UsageError(f"--chat: checkpoint meta of {args.run} has no readable tokenizer ({e})") from None
    say(f"loading {args.run} ...")
    loaded = load_run_model(args.run, args.step, overrides, log=say)
    loaded = loaded._replace(params=placed(loaded.params, mesh))
    which = "" if args.step is not None else " (the newest that verifies)"
    say(f"sampling from {args.run}, checkpoint step {loaded.meta['step']}{which}")
    if chat is not None:
        say(f"chat template and stop ids: {where}'s")
        return stream(args, loaded.params, loaded.config, chat)

    timing = {}
    texts = sample_texts(args.run, args.prompt, args.max_new_tokens,
                         temperature=0.8 if args.temperature is None else args.temperature,
                         top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                         num_samples=args.num_samples, use_cache=not args.no_cache, timing=timing,
                         loaded=loaded, log=say)
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1} of {len(texts)}")
        print(text)
    say(timing_line(timing, args.num_samples))
    return 0


def devices_mesh(args: argparse.Namespace):
    """--mesh's mesh (inference/mesh.py), or None: checked before anything loads."""
    if args.mesh is None:
        return None
    try:
        return model_mesh(args.mesh)
    except ValueError as e:
        raise UsageError(f"--mesh: {e}") from None


def placed(params, mesh):
    """params split over ``mesh`` as training stores them there (said on stderr), or as they are."""
    if mesh is None or mesh.size == 1:
        return params
    say(f"splitting the model over {mesh.size} devices: {', '.join(f'{a}={n}' for a, n in mesh.shape.items() if n > 1)}")
    return split_model(params, mesh)


def say(line: str) -> None:
    """What generate is doing, on stderr, at once."""
    print(line, file=sys.stderr, flush=True)


def one_stream(args: argparse.Namespace, mode: str) -> None:
    """Refuse the options of --run's side-by-side sampler where one stream is sampled."""
    if args.num_samples != 1:
        raise UsageError(f"--num-samples is for --run --prompt; {mode} samples one stream")
    if args.no_cache:
        raise UsageError(f"--no-cache is for --run --prompt; {mode} samples over the key/value cache")


def timing_line(timing: dict, samples: int = 1) -> str:
    """One line: the tokens, the prefill's and the decode's rates, the compile apart."""
    steps = timing["decode_tokens"] // samples
    head = f"{samples} x {steps + (timing['prefill_s'] is not None)} tokens in {timing['run_s']:.2f} s: "
    decode = (f"{_rate(timing['decode_tokens'], timing['decode_s'])} tokens/s, "
              f"{1e3 * timing['decode_s'] / steps:.2f} ms per token position" if steps else "no decode step")
    if timing["cache_len"] is None:
        return f"{head}{decode} (no cache: the whole window per token; compile {timing['compile_s']:.2f} s apart)"
    prefill = (f"prefill of {timing['prefill_tokens'] // samples} prompt tokens at "
               f"{_rate(timing['prefill_tokens'], timing['prefill_s'])} tokens/s")
    return (f"{head}{prefill}, decode at {decode} (key/value cache of {timing['cache_len']} slots; "
            f"compile {timing['compile_s']:.2f} s apart)").replace("decode at no decode step", "no decode step")


def _rate(tokens: int, seconds: float) -> str:
    rate = tokens / max(seconds, 1e-9)
    return f"{rate:,.1f}" if rate < 10 else f"{rate:,.0f}"


def run_imported(args: argparse.Namespace, overrides: dict, mesh=None) -> int:
    """``generate --init-from``: the model's own tokenizer, --chat's template, streamed."""
    if args.step is not None:
        raise UsageError("--step is for --run; --init-from samples the model as it is")
    one_stream(args, "--init-from")
    say(f"loading {args.init_from} ...")
    try:
        params, config, chat = load_model(args.init_from, model=overrides)
    except ValueError as e:
        raise UsageError(f"--init-from {args.init_from}: {e}") from None
    params = placed(params, mesh)
    say(f"sampling from {args.init_from} ({config.n_layers} layers, d_model {config.d_model}, "
        f"vocab {config.vocab_size})")
    return stream(args, params, config, chat)


def stream(args: argparse.Namespace, params, config, chat) -> int:
    """--prompt or --chat, the text streamed as it comes, ending at the model's stop ids."""
    if args.chat == "":
        return converse(args, params, config, chat)
    if args.chat is not None:
        text = render_chat(chat, [{"role": "user", "content": args.chat}])
        temperature = 0.0 if args.temperature is None else args.temperature
    else:
        text, temperature = args.prompt, 0.8 if args.temperature is None else args.temperature
        if not text:
            raise UsageError("the prompt is empty; give at least one character")
    reply(args, params, config, chat, text, temperature, echo=args.chat is None)
    return 0


def reply(args, params, config, chat, text: str, temperature: float, echo: bool = False) -> str:
    """Stream the model's continuation of ``text`` to stdout (after ``text`` itself when
    ``echo``, once the sampler is compiled, so stderr's lines come first), then its timing
    line to stderr; returns the continuation."""
    ids = chat.tokenizer.encode(text)
    timing = {}
    tokens = stream_tokens(params, config, ids, args.max_new_tokens, temperature=temperature,
                           top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_ids=chat.stop_ids,
                           timing=timing, log=say)
    pieces, waiting = [], echo  # the prompt, until the first piece has come
    for piece in stream_text(chat.tokenizer, tokens):
        if waiting:
            print(text, end="")
            waiting = False
        print(piece, end="", flush=True)
        pieces.append(piece)
    print(text if waiting else "", flush=True)
    if timing:
        say(timing_line(timing))
    return "".join(pieces)


def converse(args, params, config, chat) -> int:
    """``--chat`` without a message: each line of stdin is a user turn, answered in the
    model's template over the whole conversation so far (re-read from the start each turn;
    the oldest tokens give way when it outgrows max_seq_len). An empty line or the end of
    input ends it; at a terminal each turn is asked for with "> "."""
    messages, temperature = [], 0.0 if args.temperature is None else args.temperature
    asking = sys.stdin.isatty()
    while True:
        if asking:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line.strip()})
        answer = reply(args, params, config, chat, render_chat(chat, messages), temperature)
        messages.append({"role": "assistant", "content": answer.strip()})
