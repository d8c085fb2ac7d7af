"""`python -m generate run=<run dir or checkpoint> prompt="..." [key=value ...]`

Prints the prompt, then streams its continuation to stdout as it is sampled. The prompt comes from
`prompt=`, or from stdin when it is absent. As in training, the model sees EOS first (every document starts
after one); sampling stops at EOS unless `stop_at_eos=false`. Bad input ends with one
`error: ...` line on stderr and errors.py's exit status: 2 for a wrong command line (an unknown
key, a bad value, an unavailable device, no prompt), 1 for an unusable input (a missing run, a
bad checkpoint, torch failing on the model it holds).
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from data.cli import exit_code
from errors import EXIT_INPUT, UsageError, UserError, report_error
from generate import sample
from model.config import parse_scaling
from model.denormals import flush_denormals
from train.load import check_device

USAGE = """usage: python -m generate run=<run dir or checkpoint> [prompt="..."] [key=value ...]
  keys: max_new_tokens=128 temperature=0.8 top_k=0 (0: off) top_p=1.0 seed=0 greedy=false
        rope_scaling=as_trained|none|linear:F|ntk:F|dynamic:F|yarn:F|llama3:F stop_at_eos=true device=cpu
  the prompt is read from stdin when prompt= is absent"""


class GenerateError(UsageError):
    """A wrong command line, reported as one line."""


@dataclass
class Options:
    run: str = ""
    prompt: str | None = None
    max_new_tokens: int = 128
    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    greedy: bool = False
    rope_scaling: str = "as_trained"
    stop_at_eos: bool = True
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.run:
            raise GenerateError(f"run= is required\n{USAGE}")
        if self.max_new_tokens < 1:
            raise GenerateError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.greedy and not self.temperature > 0:  # greedy takes the argmax: no temperature
            raise GenerateError(f"temperature={self.temperature} must be > 0 (greedy=true for argmax)")
        if self.top_k < 0:
            raise GenerateError(f"top_k={self.top_k} must be >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            raise GenerateError(f"top_p={self.top_p} must be in (0, 1]")


def parse(argv: list[str]) -> Options:
    """`key=value` arguments into Options, each value converted to its field's type."""
    types = {f.name: f.type for f in fields(Options)}
    values: dict = {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key not in types:
            raise GenerateError(f"unknown argument {arg!r}; keys: {', '.join(types)}")
        kind = types[key]
        try:
            if kind == "bool":
                if value not in ("true", "false"):
                    raise ValueError
                values[key] = value == "true"
            elif kind in ("int", "float"):
                values[key] = int(value) if kind == "int" else float(value)
            else:
                values[key] = value
        except ValueError:
            raise GenerateError(f"{key}={value!r} is not a valid {kind}") from None
    return Options(**values)


class Printer:
    """Writes decoded text as tokens arrive. Byte-fallback pieces of one character come one at a
    time, so text ending in an incomplete UTF-8 sequence (U+FFFD) is held back until it is whole."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout  # sys.stdout now, not at import
        self.ids: list[int] = []
        self.shown = 0

    def echo(self, prompt: str) -> None:
        """The prompt as given, before its continuation, so the output reads as one text."""
        self.out.write(prompt)
        self.out.flush()

    def add(self, token: int | None, final: bool = False) -> None:
        if token is not None:
            self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)


def read_prompt(stream) -> str:
    """The prompt from stdin; nothing (or only whitespace) there is an error, not a silent
    generation from EOS alone (which `prompt=""` asks for explicitly)."""
    text = stream.read()
    if not text.strip():
        raise GenerateError('no prompt: stdin was empty; give prompt="..." or pipe text in '
                            '(prompt="" samples from EOS alone)')
    return text


def quiet_load(run: str, device: str):
    """`train.load.load_model` without DeepSpeed's progress lines on stdout and stderr, which
    would mix with the streamed text."""
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from train.load import load_model

        model, _, tokenizer = load_model(run, device=device)
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(args):
        print(USAGE)
        return 0
    flush_denormals()  # first: OpenMP's workers inherit it (model/denormals.py)
    try:
        opts = parse(args)
        scaling = None if opts.rope_scaling == "as_trained" else parse_scaling(opts.rope_scaling)
        if not Path(opts.run).exists():
            raise FileNotFoundError(f"run or checkpoint not found: {opts.run}")
        check_device(opts.device)
        prompt = opts.prompt if opts.prompt is not None else read_prompt(sys.stdin)
        model, tokenizer = quiet_load(opts.run, opts.device)
        if scaling is not None:
            model.set_rope_scaling(scaling.type, scaling.factor)
        ids = [tokenizer.eos_id] + tokenizer.encode(prompt)
        printer = Printer(tokenizer)
        printer.echo(prompt)
        stop = tokenizer.eos_id if opts.stop_at_eos else None
        for token in sample(model, ids, opts.max_new_tokens, opts.temperature, opts.top_k or None, opts.top_p,
                            opts.greedy, opts.seed, stop):
            if token != stop:
                printer.add(token)
        printer.add(None, final=True)
        print()
    except (UserError, ValueError, OSError, RuntimeError) as error:
        # RuntimeError: torch failing on the loaded model (out of memory, a non-finite distribution)
        return report_error(error, EXIT_INPUT if isinstance(error, RuntimeError) else exit_code(error))
    except KeyboardInterrupt:
        print()
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
