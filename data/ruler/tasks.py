"""RULER's synthetic tasks (Hsieh et al. 2024, NVIDIA/RULER), written from its definitions
(`scripts/synthetic.yaml`, `scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,
freq_words_extraction,constants}.py`), with RULER's `base` template: the task's template and its
answer prefix, nothing around them.

Lengths are the model's own tokens and are filled exactly: a case of length L is a prompt of
L - budget tokens (the EOS every document starts with, the template, the context, the question and
the answer prefix) followed by `budget` tokens of generation, as RULER's `max_seq_length` counts
input and generation. The prompt is encoded part by part (template pieces, each haystack unit and
needle with its separator) and the ids joined, so its length is the sum of the parts; the largest
haystack that fits is found by bisection, as RULER does, and the few tokens left are the next
haystack unit cut short (a noise paragraph, an essay sentence, a distractor needle; for the word
tasks, a fresh word said once, or the noise word `...`), at the end of the context.

Where this differs from RULER, on purpose: needles go into uniformly random slots among the
haystack units (RULER inserts them before random units, so never after the last one); distractor
keys never equal a real key; the counts of frequent-words extraction below the three answers are
capped one under the third, so the answer is unique at short lengths where RULER's floors can tie;
a key's value is drawn from the evaluation values (`data.tasks.held_out`) in evaluation and from
the others in training rows, so a trained model is scored on values it never saw.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

from scipy.special import zeta

from data.config import RULER_DOWNLOAD_FREE
from data.ruler.haystack import NOISE, Essay
from data.ruler.words import coded_words, common_words, needle, variable_names
from data.tasks import held_out

RULES = ("all", "part")


@dataclass(frozen=True)
class TaskSpec:
    """One task of RULER's `synthetic.yaml`: its generator (`kind`), answer budget (RULER's
    `tokens_to_generate`), scoring rule (RULER's `metric_fn`) and arguments."""

    name: str
    kind: str  # niah | vt | cwe | fwe
    budget: int
    measures: str
    haystack: str = "noise"  # noise | needle | essay
    key: str = "words"
    value: str = "numbers"
    keys: int = 1
    values: int = 1
    queries: int = 1
    rule: str = "all"  # RULER scores every synthetic task with string_match_all

    @property
    def needs_corpus(self) -> bool:
        return self.haystack == "essay"


TASKS: dict[str, TaskSpec] = {s.name: s for s in (
    TaskSpec("niah_single_1", "niah", 128, "one number under one key, in the noise paragraph"),
    TaskSpec("niah_single_2", "niah", 128, "one number under one key, in an essay", haystack="essay"),
    TaskSpec("niah_single_3", "niah", 128, "one UUID under one key, in an essay", haystack="essay", value="uuids"),
    TaskSpec("niah_multikey_1", "niah", 128, "one key's number among 4 keys' needles, in an essay",
             haystack="essay", keys=4),
    TaskSpec("niah_multikey_2", "niah", 128, "one key's number in a haystack made of other keys' needles",
             haystack="needle"),
    TaskSpec("niah_multikey_3", "niah", 128, "one UUID key's UUID in a haystack of other UUID needles",
             haystack="needle", key="uuids", value="uuids"),
    TaskSpec("niah_multivalue", "niah", 128, "all 4 numbers stored under one key, in an essay",
             haystack="essay", values=4),
    TaskSpec("niah_multiquery", "niah", 128, "the numbers of 4 keys asked at once, in an essay",
             haystack="essay", queries=4),
    TaskSpec("vt", "vt", 30, "every variable a chain of assignments gives one value (multi-hop tracing)"),
    TaskSpec("cwe", "cwe", 120, "the 10 most common words of a numbered word list (aggregation)"),
    TaskSpec("fwe", "fwe", 50, "the 3 most frequent coded words of a Zipf-distributed text (aggregation)"),
)}
DOWNLOAD_FREE = RULER_DOWNLOAD_FREE  # the tasks without an essay haystack: training rows too

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
    " The special magic {type_needle_v} for {query} mentioned in the provided text are"
)
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
    " Answer: The top 10 words that appear most often in the list are:"
)
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)
DEPTHS = tuple(round(100 * i / 39) for i in range(40))  # RULER's np.linspace(0, 100, 40), rounded
VT_FEWSHOT_TOKENS = 500  # RULER builds its one-shot example at max_seq_length 500
CWE_LARGE = 4096  # RULER's CWE counts: 30 / 3 repeats from this length on, 6 / 1 below it
CWE_COMMON = 10
FWE_NOISE = "..."
FWE_ALPHA = 2.0


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Settings:
    """What a user may change about the tasks: the answer budget (None: RULER's per task), variable
    tracking's hops and chains (RULER: 4 and 1), and RULER's one-shot examples (VT, CWE)."""

    budget: Optional[int] = None
    hops: int = 4
    chains: int = 1
    fewshot: bool = True


@dataclass(frozen=True)
class RulerCase:
    """One prompt: `tokens` (exactly `length - budget` ids), what a right answer must contain
    (`answers`, RULER's `outputs`), `continuation` (a right answer's text, for training rows and
    the oracle), and `haystack`, the haystack units in the context."""

    task: str
    length: int
    tokens: list[int]
    budget: int
    answers: tuple[str, ...]
    continuation: str
    haystack: int


class TooShort(ValueError):
    """The length cannot hold the task's prompt without haystack and its answer budget."""

    def __init__(self, task: str, length: int, needed: int):
        super().__init__(f"{task} at length {length}: its prompt without haystack (template, needles, question) "
                         f"and its answer budget take {needed} tokens")
        self.needed = needed


class Encoder:
    """The tokenizer's ids of a text, remembered (haystack units repeat)."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[str, tuple[int, ...]] = {}

    def __call__(self, text: str) -> tuple[int, ...]:
        ids = self.cache.get(text)
        if ids is None:
            ids = tuple(self.tokenizer.encode(text))
            if len(self.cache) < 200_000:
                self.cache[text] = ids
        return ids


Layout = Callable[[int], tuple[list[str], Iterator[str]]]  # n units -> context pieces, filler pieces


def _split(template: str, **fields: str) -> tuple[str, str]:
    """A template's text before and after its context."""
    head, tail = template.format(context="\x00", **fields).split("\x00")
    return head, tail


def _slots(rng: random.Random, units: list[str], inserts: Sequence[str]) -> list[str]:
    """`inserts`, in order, at uniformly random slots among `units`."""
    total = len(units) + len(inserts)
    where = set(rng.sample(range(total), len(inserts)))
    out, u, i = [], iter(units), iter(inserts)
    for slot in range(total):
        out.append(next(i) if slot in where else next(u))
    return out


def fill(enc: Encoder, task: str, length: int, budget: int, head: Sequence[int], tail: Sequence[int], sep: str,
         layout: Layout) -> tuple[list[int], int]:
    """`head` + the context + `tail`, exactly `length - budget` ids: the most haystack units `n`
    whose context fits (bisection), then filler pieces, the last cut to the ids left. Returns the
    ids and n."""
    room = length - budget - len(head) - len(tail)

    def ids_of(pieces: Sequence[str]) -> list[int]:
        return [t for i, p in enumerate(pieces) for t in enc(sep + p if i else p)]

    def size(n: int) -> float:
        try:
            pieces, _ = layout(n)
        except IndexError:  # more units than the haystack has
            return math.inf
        return sum(len(enc(sep + p if i else p)) for i, p in enumerate(pieces))

    if size(0) > room:
        raise TooShort(task, length, length - room + int(size(0)))
    lo, hi = 0, 1
    while size(hi) <= room:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= room else (lo, mid)
    pieces, filler = layout(lo)
    context = ids_of(pieces)
    while len(context) < room:
        piece = next(filler, None)
        if piece is None:
            raise ValueError(f"{task} at length {length}: the essay haystack ran out of text; "
                             "name a larger corpus with sources=")
        context += list(enc(sep + piece if context else piece))[: room - len(context)]
    return list(head) + context + list(tail), lo


# ----------------------------------------------------------------------------- needle in a haystack


def _niah(spec: TaskSpec, enc: Encoder, length: int, rng: random.Random, budget: Optional[int], evaluation: bool,
          prefix: Sequence[int], essay: Optional[Essay]) -> RulerCase:
    n_keys = max(spec.keys, spec.queries)
    asked = set(rng.sample(range(n_keys), spec.queries))
    keys: list[str] = []
    while len(keys) < n_keys:
        key = needle(spec.key, rng)
        if key not in keys:
            keys.append(key)
    values: list[list[str]] = []
    used: set[str] = set()
    for k in range(n_keys):
        row = []
        while len(row) < spec.values:
            value = needle(spec.value, rng)
            if value not in used and (k not in asked or held_out(value) == evaluation):
                row.append(value)
                used.add(value)
        values.append(row)
    needles = [NEEDLE.format(type_needle_v=spec.value, key=keys[k], value=v) for k in range(n_keys) for v in values[k]]
    rng.shuffle(needles)
    order = rng.sample(sorted(asked), spec.queries)
    queries = [keys[k] for k in order]
    answers = tuple(v for k in order for v in values[k])
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, kind = NIAH_TEMPLATE, spec.value
    if spec.queries * spec.values == 1:  # RULER's singular wording
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        kind = kind[:-1]
    head, tail = _split(template, type_needle_v=kind, query=query)
    continuation = " " + ", ".join(answers) + "."
    layout_seed = rng.getrandbits(64)

    def distractors(r: random.Random) -> Iterator[str]:
        while True:
            key = needle(spec.key, r)
            if key not in keys:
                yield NEEDLE.format(type_needle_v=spec.value, key=key, value=needle(spec.value, r))

    def layout(n: int) -> tuple[list[str], Iterator[str]]:
        r = random.Random(layout_seed)
        if spec.haystack == "essay":
            assert essay is not None
            if n >= len(essay.sentences):
                raise IndexError(n)
            depths = sorted(int(n * d / 100) for d in r.sample(DEPTHS, len(needles)))
            pieces, last = [], 0
            for pos, text in zip(depths, needles):
                pieces += list(essay.sentences[last:pos]) + [text]
                last = pos
            return pieces + list(essay.sentences[last:n]), iter(essay.sentences[n:])
        if spec.haystack == "needle":
            stream = distractors(r)
            return _slots(r, [next(stream) for _ in range(n)], needles), stream
        return _slots(r, [NOISE] * n, needles), iter(lambda: NOISE, None)

    return _case(spec, enc, length, budget, prefix, head, tail, "\n" if spec.haystack != "essay" else " ", layout,
                 answers, continuation)


def _case(spec: TaskSpec, enc: Encoder, length: int, budget: Optional[int], prefix: Sequence[int], head: str,
          tail: str, sep: str, layout: Layout, answers: tuple[str, ...], continuation: str,
          before: Sequence[int] = ()) -> RulerCase:
    """Fill the context of a drawn case; `budget` None: the continuation's own tokens (a training row)."""
    budget = len(enc(continuation)) if budget is None else budget
    tokens, n = fill(enc, spec.name, length, budget, [*prefix, *before, *enc(head)], enc(tail), sep, layout)
    return RulerCase(spec.name, length, tokens, budget, answers, continuation, n)


# ----------------------------------------------------------------------------- variable tracking


def _vt_parts(rng: random.Random, hops: int, chains: int, letters: int,
              evaluation: bool) -> tuple[list[list[str]], list[list[str]]]:
    """Chains of assignments: `VAR A = 12345`, then `VAR B = VAR A ` ... (RULER's lines, trailing
    space included), one value per chain; the first chain's, the one asked, is drawn from the
    evaluation or the training values."""
    names = variable_names(rng, chains * (hops + 1), letters)
    values: list[str] = []
    while len(values) < chains:
        v = str(rng.randint(10000, 99999))
        if v not in values and (values or held_out(v) == evaluation):
            values.append(v)
    groups = [names[c * (hops + 1) : (c + 1) * (hops + 1)] for c in range(chains)]
    lines = [[f"VAR {g[0]} = {values[c]}"] + [f"VAR {g[j + 1]} = VAR {g[j]} " for j in range(hops)]
             for c, g in enumerate(groups)]
    return groups, lines


def _vt_layout(rng: random.Random, lines: list[list[str]]) -> Layout:
    layout_seed = rng.getrandbits(64)

    def layout(n: int) -> tuple[list[str], Iterator[str]]:
        r = random.Random(layout_seed)
        pieces = [NOISE] * n
        for chain in lines:
            pieces = _slots(r, pieces, chain)
        return pieces, iter(lambda: NOISE, None)

    return layout


def _vt(spec: TaskSpec, enc: Encoder, length: int, rng: random.Random, budget: Optional[int], evaluation: bool,
        prefix: Sequence[int], settings: Settings) -> RulerCase:
    groups, lines = _vt_parts(rng, settings.hops, settings.chains, 5, evaluation)
    query = lines[0][0].split("= ")[-1]
    head, tail = _split(VT_TEMPLATE, query=query, num_v=str(settings.hops + 1))
    answers = tuple(groups[0])
    continuation = " ".join(answers)
    before: list[int] = []
    if settings.fewshot:
        before = _vt_example(spec, enc, length, rng, budget if budget is not None else len(enc(continuation)),
                             prefix, settings)
    return _case(spec, enc, length, budget, prefix, head, tail, "\n", _vt_layout(rng, lines), answers,
                 continuation, before)


def _vt_example(spec: TaskSpec, enc: Encoder, length: int, rng: random.Random, budget: int, prefix: Sequence[int],
                settings: Settings) -> list[int]:
    """RULER's one-shot example: a VT prompt with 3-letter names and at most 10 hops, filled to
    `VT_FEWSHOT_TOKENS` (at most half the room the length leaves), its answer, a newline."""
    hops = min(10, settings.hops)
    groups, lines = _vt_parts(rng, hops, settings.chains, 3, evaluation=False)
    head, tail = _split(VT_TEMPLATE, query=lines[0][0].split("= ")[-1], num_v=str(hops + 1))
    size = min(VT_FEWSHOT_TOKENS, (length - budget - len(prefix)) // 2)
    try:
        tokens, _ = fill(enc, spec.name, size, 0, enc(head), enc(tail), "\n", _vt_layout(rng, lines))
    except TooShort as e:
        raise TooShort(spec.name, length, 2 * e.needed + budget + len(prefix)) from None
    return tokens + list(enc(" " + " ".join(groups[0]) + "\n"))


# ----------------------------------------------------------------------------- common words


def _cwe_items(words: Sequence[str], start: int = 0) -> list[str]:
    return [f"{start + i + 1}. {w}" for i, w in enumerate(words)]


def _cwe(spec: TaskSpec, enc: Encoder, length: int, rng: random.Random, budget: Optional[int],
         prefix: Sequence[int], settings: Settings) -> RulerCase:
    vocabulary = common_words()
    large = length >= CWE_LARGE
    common_repeats, rare_repeats = (30, 3) if large else (6, 1)
    head, tail = _split(CWE_TEMPLATE)
    before: list[int] = []
    if settings.fewshot:  # RULER's example: 40 words (10 x 10, 30 x 3) at long lengths, else 20 (10 x 3, 10 x 1)
        n_words, c, u = (40, 10, 3) if large else (20, 3, 1)
        sample = rng.sample(vocabulary, n_words)
        listed = sample[:CWE_COMMON] * c + sample[CWE_COMMON:] * u
        rng.shuffle(listed)
        example = head + " ".join(_cwe_items(listed)) + tail + " " + " ".join(_cwe_items(sample[:CWE_COMMON]))
        before = list(enc(example + "\n"))
    order = list(vocabulary)
    rng.shuffle(order)
    common = order[:CWE_COMMON]
    layout_seed = rng.getrandbits(64)

    def layout(n: int) -> tuple[list[str], Iterator[str]]:
        if CWE_COMMON + n >= len(order):
            raise IndexError(n)
        listed = common * common_repeats + order[CWE_COMMON : CWE_COMMON + n] * rare_repeats
        random.Random(layout_seed).shuffle(listed)
        return _cwe_items(listed), iter(_cwe_items(order[CWE_COMMON + n :], len(listed)))

    answers = tuple(common)
    return _case(spec, enc, length, budget, prefix, head, tail, " ", layout, answers,
                 " " + " ".join(_cwe_items(common)), before)


# ----------------------------------------------------------------------------- frequent words


def zipf_counts(n_words: int, vocab: int, alpha: float = FWE_ALPHA) -> list[int]:
    """RULER's counts: word of rank k appears floor(n_words k^-alpha / zeta(alpha)) times; the
    words below the three answers (ranks 2-4) are capped one under the third."""
    counts = [int(n_words * k**-alpha / zeta(alpha)) for k in range(1, vocab + 1)]
    if vocab > 4:
        counts[4:] = [min(c, counts[3] - 1) for c in counts[4:]]
    return counts


def _fwe(spec: TaskSpec, enc: Encoder, length: int, rng: random.Random, budget: Optional[int],
         prefix: Sequence[int]) -> RulerCase:
    room = length - (spec.budget if budget is None else budget)
    vocab_size = room // 50  # RULER's vocabulary: (max_seq_length - tokens_to_generate) // 50
    if vocab_size < 4:
        raise TooShort(spec.name, length, 200 + (length - room))
    vocab = [FWE_NOISE] + coded_words(rng, vocab_size - 1)
    answers = tuple(vocab[1:4])
    smallest = math.ceil(4**FWE_ALPHA * zeta(FWE_ALPHA))  # the fewest words that say the third answer once
    head, tail = _split(FWE_TEMPLATE)
    layout_seed = rng.getrandbits(64)

    def layout(n: int) -> tuple[list[str], Iterator[str]]:
        counts = zipf_counts(smallest + n, vocab_size)
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(layout_seed).shuffle(words)
        return words, iter(lambda: FWE_NOISE, None)

    return _case(spec, enc, length, budget, prefix, head, tail, " ", layout, answers, " " + ", ".join(answers) + ".")


# ----------------------------------------------------------------------------- cases


def build_case(spec: TaskSpec, enc: Encoder, length: int, rng: random.Random, *, settings: Settings = Settings(),
               evaluation: bool = True, prefix: Sequence[int] = (), essay: Optional[Essay] = None,
               training_row: bool = False) -> RulerCase:
    """One case of `spec` at `length` tokens: the prompt and the settings' (else RULER's) answer
    budget; a `training_row` instead leaves room for its continuation alone (prompt + continuation
    = length) and asks a training value."""
    budget = None if training_row else spec.budget if settings.budget is None else settings.budget
    if spec.needs_corpus and essay is None:
        raise ValueError(f"{spec.name} needs an essay haystack (a text corpus)")
    if spec.kind == "niah":
        return _niah(spec, enc, length, rng, budget, evaluation, prefix, essay)
    if spec.kind == "vt":
        return _vt(spec, enc, length, rng, budget, evaluation, prefix, settings)
    if spec.kind == "cwe":
        return _cwe(spec, enc, length, rng, budget, prefix, settings)
    return _fwe(spec, enc, length, rng, budget, prefix)


def case_rng(task: str, stream: str, seed: int, length: int) -> random.Random:
    """The generator of one task's evaluation cases at one length (`data.tasks.case_rng`'s rule:
    independent across lengths, tasks, streams and seeds)."""
    return random.Random(f"ruler/{task}/{stream}/{seed}/{length}")  # str seeds hash with SHA-512: stable


def make_cases(task: str, tokenizer: TextTokenizer, length: int, n_cases: int, seed: int, *, stream: str = "eval",
               settings: Settings = Settings(), prefix: Sequence[int] = (), essay: Optional[Essay] = None,
               encoder: Optional[Encoder] = None) -> list[RulerCase]:
    """`n_cases` evaluation cases of `task` at `length`, a function of (task, stream, seed, length)."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}: one of {', '.join(TASKS)}")
    if n_cases < 1:
        raise ValueError(f"cases={n_cases} must be >= 1")
    enc = encoder or Encoder(tokenizer)
    rng = case_rng(task, stream, seed, length)
    return [build_case(TASKS[task], enc, length, rng, settings=settings, prefix=prefix, essay=essay)
            for _ in range(n_cases)]
