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

Where this differs from RULER, on purpose: in the noise and needle haystacks needles go into
uniformly random slots among the haystack units (RULER inserts them before random units, so never
after the last one); in an essay they go at RULER's depths counted in tokens, at the word boundary
nearest each (RULER: the sentence boundary nearest the depth counted in sentences; a code corpus's
sentences run from 4 to hundreds of tokens, which would pull the needles off their depth); distractor
keys never equal a real key; the counts of frequent-words extraction below the three answers are
capped one under the third, so the answer is unique at short lengths where RULER's floors can tie;
a key's value is drawn from the evaluation values (`data.tasks.held_out`) in evaluation and from
the others in training rows, so a trained model is scored on values it never saw; an answer budget
shorter than a case's answer is refused (`AnswerOverBudget`), since it would cap the score unseen.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

from scipy.special import zeta

from data.config import RULER_DOWNLOAD_FREE
from data.ruler.haystack import NOISE, Essay
from data.ruler.words import coded_words, common_words, large_word_list, needle, variable_names
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
CWE_EXAMPLES = ((40, 10, 3), (20, 3, 1))  # RULER's one-shot examples (words, common and rare repeats): long, short
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
    the oracle), `haystack`, the haystack units in the context (an essay's: words), and `depths`
    (NIAH), where each answer's needle sits: the share of the context's other tokens (the answers'
    needles left out) before it, in percent."""

    task: str
    length: int
    tokens: list[int]
    budget: int
    answers: tuple[str, ...]
    continuation: str
    haystack: int
    depths: tuple[float, ...] = ()


class TooShort(ValueError):
    """The length cannot hold the task's prompt without haystack and its answer budget."""

    def __init__(self, task: str, length: int, needed: int):
        super().__init__(f"{task} at length {length}: its prompt without haystack (template, needles, question) "
                         f"and its answer budget take {needed} tokens")
        self.needed = needed


class OutOfHaystack(ValueError):
    """The haystack has no more units to fill the length with."""


class AnswerOverBudget(ValueError):
    """An answer budget shorter than a case's answer: generation would stop before a right answer ends."""

    def __init__(self, task: str, length: int, budget: int, needed: int, rulers: bool):
        whose = f"RULER's answer budget for {task}, {budget} tokens," if rulers else f"ruler.budget={budget}"
        super().__init__(f"{whose} is shorter than {task}'s answers at length {length} (up to {needed} tokens in "
                         f"this tokenizer) and would cap its scores: set ruler.budget >= {needed}"
                         + ("" if rulers else " or null (RULER's per task)"))
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
         layout: Layout, measure: Optional[Callable[[int], float]] = None) -> tuple[list[int], int]:
    """`head` + the context + `tail`, exactly `length - budget` ids: the most haystack units `n`
    whose context fits (bisection), then filler pieces, the last cut to the ids left. Returns the
    ids and n. `measure(n)`, where given, is the context's tokens for n units without laying them
    out (inf past the haystack's end)."""
    room = length - budget - len(head) - len(tail)

    def ids_of(pieces: Sequence[str]) -> list[int]:
        return [t for i, p in enumerate(pieces) for t in enc(sep + p if i else p)]

    def laid_out(n: int) -> float:
        try:
            pieces, _ = layout(n)
        except IndexError:  # more units than the haystack has
            return math.inf
        return sum(_sizes(enc, pieces, sep))

    size = measure or laid_out

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
            raise OutOfHaystack(f"{task} at length {length}: the essay haystack ran out of text; "
                                "name a larger corpus with sources=")
        context += list(enc(sep + piece if context else piece))[: room - len(context)]
    return list(head) + context + list(tail), lo


def _sizes(enc: Encoder, pieces: Sequence[str], sep: str) -> list[int]:
    """Each piece's tokens in a context (every piece but the first after `sep`)."""
    return [len(enc(sep + p if i else p)) for i, p in enumerate(pieces)]


def _at_depths(enc: Encoder, units: list[str], inserts: Sequence[str], depths: Sequence[int], sep: str) -> list[str]:
    """`units` with `inserts` put, in order, at `depths` (percent, ascending) of the units' tokens,
    each at the word boundary nearest its depth (a unit is cut there)."""
    sizes = _sizes(enc, units, sep)
    total = sum(sizes)
    cuts: dict[int, list[tuple[int, str]]] = {}
    i, start = 0, 0
    for depth, text in zip(depths, inserts):
        target = depth / 100 * total
        while i < len(units) and start + sizes[i] <= target:
            start, i = start + sizes[i], i + 1
        if i == len(units):
            cuts.setdefault(i, []).append((0, text))
            continue
        best, gap, at = 0, target - start, start
        for k, word in enumerate(units[i].split(" "), 1):
            at += len(enc(sep + word if i or k > 1 else word))
            if abs(target - at) < gap:
                best, gap = k, abs(target - at)
        cuts.setdefault(i, []).append((best, text))
    out: list[str] = []
    for i, unit in enumerate(units):
        words, last = unit.split(" "), 0
        for k, text in cuts.get(i, []):
            out += [" ".join(words[last:k])] * (k > last) + [text]
            last = k
        out += [" ".join(words[last:])] * (last < len(words))
    return out + [text for _, text in cuts.get(len(units), [])]


def _needle_depths(enc: Encoder, pieces: Sequence[str], context: int, sep: str,
                   needles: Sequence[str]) -> tuple[float, ...]:
    """Where each of `needles` sits in a context of `context` tokens that starts with `pieces`: the
    share of the context's other tokens (every token not in one of `needles`) before it, in percent."""
    sizes = _sizes(enc, pieces, sep)
    wanted = set(needles)
    where = {p: i for i, p in enumerate(pieces) if p in wanted}
    haystack = context - sum(sizes[i] for i in where.values())
    before = [0]
    for p, n in zip(pieces, sizes):
        before.append(before[-1] + (0 if p in where else n))
    return tuple(round(100 * before[where[text]] / haystack, 2) for text in needles)


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
    asked_needles = [NEEDLE.format(type_needle_v=spec.value, key=keys[k], value=v) for k in order for v in values[k]]
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
            units, rest = essay.first(n)
            return _at_depths(enc, units, needles, sorted(r.sample(DEPTHS, len(needles))), " "), iter(rest)
        if spec.haystack == "needle":
            stream = distractors(r)
            return _slots(r, [next(stream) for _ in range(n)], needles), stream
        return _slots(r, [NOISE] * n, needles), iter(lambda: NOISE, None)

    sep = "\n" if spec.haystack != "essay" else " "
    case = _case(spec, enc, length, budget, prefix, head, tail, sep, layout, answers, continuation)
    context = len(case.tokens) - len(prefix) - len(enc(head)) - len(enc(tail))
    return dataclasses.replace(case, depths=_needle_depths(enc, layout(case.haystack)[0], context, sep, asked_needles))


def _case(spec: TaskSpec, enc: Encoder, length: int, budget: Optional[int], prefix: Sequence[int], head: str,
          tail: str, sep: str, layout: Layout, answers: tuple[str, ...], continuation: str,
          before: Sequence[int] = (), measure: Optional[Callable[[int], float]] = None) -> RulerCase:
    """Fill the context of a drawn case; `budget` None: the continuation's own tokens (a training row)."""
    budget = len(enc(continuation)) if budget is None else budget
    tokens, n = fill(enc, spec.name, length, budget, [*prefix, *before, *enc(head)], enc(tail), sep, layout, measure)
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
    `VT_FEWSHOT_TOKENS` (at most half the room the length leaves), its answer, a blank line."""
    hops = min(10, settings.hops)
    groups, lines = _vt_parts(rng, hops, settings.chains, 3, evaluation=False)
    head, tail = _split(VT_TEMPLATE, query=lines[0][0].split("= ")[-1], num_v=str(hops + 1))
    size = min(VT_FEWSHOT_TOKENS, (length - budget - len(prefix)) // 2)
    try:
        tokens, _ = fill(enc, spec.name, size, 0, enc(head), enc(tail), "\n", _vt_layout(rng, lines))
    except TooShort as e:
        raise TooShort(spec.name, length, 2 * e.needed + budget + len(prefix)) from None
    return tokens + list(enc(" " + " ".join(groups[0]) + "\n\n"))


# ----------------------------------------------------------------------------- common words


def _cwe_items(words: Iterable[str], start: int = 0) -> Iterator[str]:
    """RULER's numbered list `1. w 2. v ...` as pieces: each number and each word (the same text;
    the numbers' ids are shared by every haystack size tried)."""
    for i, word in enumerate(words, start + 1):
        yield f"{i}."
        yield word


def _cwe(spec: TaskSpec, enc: Encoder, length: int, rng: random.Random, budget: Optional[int],
         prefix: Sequence[int], settings: Settings) -> RulerCase:
    """RULER's list: 10 common words said 30 times and rare ones 3 times from `CWE_LARGE` on (6 and
    1 below), drawn from wonderwords' words, or all from `large_word_list` where the length needs
    more words than those (RULER's switch). The one-shot example is RULER's for the length, its
    short-length one (20 words) where the long one leaves no room (a tokenizer with more tokens per
    word than RULER's)."""
    large = length >= CWE_LARGE
    common_repeats, rare_repeats = (30, 3) if large else (6, 1)
    head, tail = _split(CWE_TEMPLATE)
    sample = rng.sample(common_words(), CWE_EXAMPLES[0][0])
    example_seed, order_seed, layout_seed = rng.getrandbits(64), rng.getrandbits(64), rng.getrandbits(64)

    def example(words: int, common: int, rare: int) -> list[int]:
        listed = sample[:CWE_COMMON] * common + sample[CWE_COMMON:words] * rare
        random.Random(example_seed).shuffle(listed)
        text = head + " ".join(_cwe_items(listed)) + tail + " " + " ".join(_cwe_items(sample[:CWE_COMMON]))
        return list(enc(text + "\n"))

    def attempt(before: list[int], vocabulary: Sequence[str]) -> RulerCase:
        order = list(vocabulary)
        random.Random(order_seed).shuffle(order)
        common = order[:CWE_COMMON]

        def layout(n: int) -> tuple[list[str], Iterator[str]]:
            if CWE_COMMON + n >= len(order):
                raise IndexError(n)
            listed = common * common_repeats + order[CWE_COMMON : CWE_COMMON + n] * rare_repeats
            random.Random(layout_seed).shuffle(listed)
            return list(_cwe_items(listed)), _cwe_items(order[CWE_COMMON + n :], len(listed))

        numbers, rare, said = [0], [0], sum(len(enc(" " + w)) for w in common) * common_repeats

        def measure(n: int) -> float:  # the layout's tokens, whatever its order: RULER's 30-fold lists are long
            if CWE_COMMON + n >= len(order):
                return math.inf
            items = CWE_COMMON * common_repeats + n * rare_repeats
            for k in range(len(numbers), items + 1):  # the first piece, "1.", has no separator
                numbers.append(numbers[-1] + len(enc(f" {k}." if k > 1 else "1.")))
            for w in order[CWE_COMMON + len(rare) - 1 : CWE_COMMON + n]:
                rare.append(rare[-1] + len(enc(" " + w)))
            return numbers[items] + said + rare_repeats * rare[n]

        return _case(spec, enc, length, budget, prefix, head, tail, " ", layout, tuple(common),
                     " " + " ".join(_cwe_items(common)), before, measure)

    def build(shape: tuple[int, int, int]) -> RulerCase:
        before = example(*shape) if settings.fewshot else []
        try:
            return attempt(before, common_words())
        except OutOfHaystack:
            try:
                return attempt(before, large_word_list())
            except OutOfHaystack:
                raise ValueError(f"{spec.name} at length {length} needs more than the {len(large_word_list())} "
                                 "words of its larger word list") from None

    shapes = CWE_EXAMPLES if large and settings.fewshot else CWE_EXAMPLES[1:]
    for shape in shapes[:-1]:
        try:
            return build(shape)
        except TooShort:
            pass
    return build(shapes[-1])


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
    """`n_cases` evaluation cases of `task` at `length`, a function of (task, stream, seed, length);
    `AnswerOverBudget` where the budget is shorter than a right answer."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}: one of {', '.join(TASKS)}")
    if n_cases < 1:
        raise ValueError(f"cases={n_cases} must be >= 1")
    enc = encoder or Encoder(tokenizer)
    rng = case_rng(task, stream, seed, length)
    cases = [build_case(TASKS[task], enc, length, rng, settings=settings, prefix=prefix, essay=essay)
             for _ in range(n_cases)]
    needed = max(len(enc(c.continuation)) for c in cases)
    if needed > cases[0].budget:
        raise AnswerOverBudget(task, length, cases[0].budget, needed, settings.budget is None)
    return cases
