"""What a training run tells its user: the resolved settings and the data at the
start, the compile time on its own, steady-state speed, and the summary at the end.

Timing words, used the same way everywhere:
  compile_s     the first step of this call: tracing, XLA compilation and one step
  steady        every later step: its tokens / its time (validation and checkpoint
                writing excluded), the speed a longer run keeps
  overall       all tokens of this call / training time (compile_s + steady time)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import textwrap
import time

import jax
from tqdm import tqdm  # the text bar everywhere: tqdm.auto warns in Jupyter without ipywidgets

from jaxformer.model.config import PRESET_TRAINING, PRESETS
from jaxformer.model.params import init_params
from jaxformer.observe.words import plural

LN2 = math.log(2.0)


def _fields(d: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in d.items())


def settings_block(settings, config, n_params: int, devices: str, grads: str, notes=(),
                   fields: bool = True) -> list[str]:
    """The resolved model and training settings, every field, a few wrapped lines; ``grads``:
    the gradient source in words (training.settings.grads_text). ``fields`` False (a run from
    given params, a fine-tune: the command printed each chosen value with its source, and
    config.toml keeps them all): the model's size, the gradients and the devices alone."""
    if not fields:
        family = f" ({config.family})" if config.family else ""
        return [f"model    the initial params{family}: {n_params:,} params ({settings.dtype}); "
                f"every setting in config.toml", f"grads    {grads}", f"devices  {devices}"]
    lines = [f"model    {settings.preset}: {n_params:,} params ({settings.dtype})"]
    wrap = dict(width=100, initial_indent=" " * 9, subsequent_indent=" " * 9)
    lines += textwrap.wrap(_fields(config.to_dict()), **wrap)
    lines.append("training")
    train = {k: v for k, v in settings.to_dict().items() if k not in ("preset", "grads")}  # own lines
    lines += textwrap.wrap(_fields(train), **wrap)
    lines += [f"         note: {note}" for note in notes]
    lines.append(f"grads    {grads}")
    lines.append(f"devices  {devices}")
    return lines


def data_lines(corpus: str, tokenizer, n_train: int, n_val: int) -> list[str]:
    """The corpus line (data.describe_corpus) and what the tokenizer made of it."""
    return [f"corpus   {corpus}",
            f"tokens   {tokenizer.kind} tokenizer, vocab {tokenizer.vocab_size}; "
            f"{n_train:,} train / {n_val:,} validation tokens"]


def val_bits(val_loss: float, tokenizer_kind: str) -> dict:
    """Validation loss in bits per byte (byte tokenizer) or per character (char); {}
    for a subword tokenizer (its loss per token is the figure)."""
    key = {"byte": "val_bits_per_byte", "char": "val_bits_per_char"}.get(tokenizer_kind)
    return {key: val_loss / LN2} if key else {}


@dataclasses.dataclass
class StepClock:
    """Times a training call: its first step apart (compile), the others as the steady
    state; ``paused()`` excludes validation and checkpoint writing."""

    tokens_per_step: int
    t: float = dataclasses.field(default_factory=time.perf_counter)
    compile_s: float | None = None
    steady_s: float = 0.0
    steady_steps: int = 0

    def step_done(self, n: int = 1) -> float | None:
        """Call when the results of the ``n`` steps since the last call are on the host
        (the loop fetches the first step of a call alone); returns compile_s after the
        first call."""
        now = time.perf_counter()
        if self.compile_s is None:
            self.compile_s = now - self.t
            self.t = now
            return self.compile_s
        self.steady_s += now - self.t
        self.steady_steps += n
        self.t = now
        return None

    @contextlib.contextmanager
    def paused(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.t += time.perf_counter() - t0

    def summary(self) -> dict:
        steps = self.steady_steps + (self.compile_s is not None)
        train_s = (self.compile_s or 0.0) + self.steady_s
        tokens = steps * self.tokens_per_step
        return {
            "steps": steps, "tokens": tokens, "compile_s": self.compile_s,
            "steady_steps": self.steady_steps, "steady_s": self.steady_s,
            "steady_tokens_per_s": (self.steady_steps * self.tokens_per_step / self.steady_s
                                    if self.steady_s > 0 else None),
            "train_s": train_s, "overall_tokens_per_s": tokens / train_s if train_s > 0 else None,
        }


def compile_line(compile_s: float, step: int) -> str:
    return f"step {step} (compile + first step) took {compile_s:.2f} s; progress and speed from here on"


def summary_line(t: dict) -> str:
    """The end of a training call, each speed named."""
    if not t["steps"]:
        return "no steps run"
    steady = (f"steady state {t['steady_tokens_per_s']:,.0f} tokens/s over "
              f"{plural(t['steady_steps'], 'step')} ({t['steady_s']:.2f} s of steps alone)"
              if t["steady_tokens_per_s"] else "no steady-state steps")
    return (f"trained {plural(t['steps'], 'step')}, {t['tokens']:,} tokens in {t['train_s']:.2f} s: compile + "
            f"first step {t['compile_s']:.2f} s; {steady}; overall {t['overall_tokens_per_s']:,.0f} "
            f"tokens/s (all tokens / training time incl. compile; validation and checkpoints excluded)")


class Progress:
    """The tqdm bar of finished steps. Until the first step of a call finished (tracing,
    compiling and one step) it says "compiling" and shows no rate; then it opens again from
    that step, so its rate and ETA come from the steady state (the compile is timed apart).
    ``finished(step)``: the steps through ``step`` are done (their results are ready)."""

    COMPILING = "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [compiling]"

    def __init__(self, start: int, total: int, enabled: bool, file=None):
        self.total, self.enabled, self.file = total, enabled, file
        self.done, self.steady, self.postfix = start, False, {}
        self.bar = self._open(start, bar_format=self.COMPILING, leave=False)

    def _open(self, n: int, **kwargs):
        return tqdm(total=self.total, initial=n, disable=not self.enabled, unit="step",
                    dynamic_ncols=True, file=self.file, **kwargs)

    def finished(self, step: int) -> None:
        if step <= self.done:
            return
        if self.steady:
            self.bar.update(step - self.done)
        else:  # the first step finished: the compiling bar goes, the steady one starts here
            self.bar.close()
            self.bar, self.steady = self._open(step), True
            self.bar.set_postfix(**self.postfix)
        self.done = step

    def set_postfix(self, **postfix) -> None:
        """Values shown after the bar (once it is steady)."""
        self.postfix = postfix
        if self.steady:
            self.bar.set_postfix(**postfix)

    @contextlib.contextmanager
    def writing(self):
        """Lines written inside (a log line) do not break the bar: it is cleared, then drawn again."""
        if not self.enabled:
            yield
            return
        with tqdm.external_write_mode(file=self.file or sys.stderr):
            yield

    def close(self) -> None:
        self.bar.close()


def recipe_text(recipe: dict) -> str:
    """A preset's training recipe (config.PRESET_TRAINING) as name=value pairs."""
    return _fields(recipe)


def presets_table() -> list[str]:
    """Each preset's shape, parameter count (vocab 256: the byte tokenizer) and recipe."""
    head = ("preset", "L", "D", "H", "F", "T", "norm", "activation", "positions", "params (V=256)")
    rows = []
    for name, config in PRESETS.items():
        config = config.replace(vocab_size=256)
        shapes = jax.eval_shape(lambda c=config: init_params(jax.random.PRNGKey(0), c))
        n = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))
        rows.append((name, config.n_layers, config.d_model, config.n_heads, config.d_ff,
                     config.max_seq_len, config.norm, config.activation, config.positions, f"{n:,}"))
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head))]
    fmt = "  ".join(f"{{:{'>' if i in (1, 2, 3, 4, 5, 9) else '<'}{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*head)] + [fmt.format(*r) for r in rows]
    lines += ["", "L layers, D d_model, H heads, F d_ff, T max_seq_len; training recipes "
              "(flags of `jaxformer train` override them):"]
    lines += [f"  {name:<{widths[0]}}  {recipe_text(PRESET_TRAINING.get(name, {}))}" for name in PRESETS]
    return lines
