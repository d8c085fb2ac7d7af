"""RULER's synthetic tasks (data/ruler, eval/ruler): each prompt checked against RULER's definition
(templates, needle counts, key and value formats, hop structure, word frequencies, exact token
length), an oracle that reads the answer from the prompt text scores 1.0 on every task, an answerer
guessing among the prompt's candidates scores its chance level, and the scorer's rules on
hand-made answers. The tokenizer is the session's real stdlib tokenizer (tests/conftest.py)."""

from __future__ import annotations

import math
import random
import re
from collections import Counter

import pytest

from data.config import DataConfig, SourceConfig
from data.ruler.haystack import NOISE, read_essay, sentences_of
from data.ruler.tasks import (
    DEPTHS,
    TASKS,
    AnswerOverBudget,
    Settings,
    TooShort,
    make_cases,
    zipf_counts,
)
from data.ruler.words import coded_words, common_words, large_word_list, needle, variable_names, word_list
from data.synthetic import SyntheticCursor
from data.tasks import held_out
from eval.ruler.score import cell_interval, postprocess, string_match

NEEDLE = re.compile(r"One of the special magic (numbers|uuids) for (.+?) is: ([0-9a-f-]+)\.")
UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
VAR_VALUE = re.compile(r"VAR ([A-Z]+) = (\d+)")
VAR_VAR = re.compile(r"VAR ([A-Z]+) = VAR ([A-Z]+)")


@pytest.fixture(scope="module")
def essay(tok):
    return read_essay(DataConfig(), 20_000)


def text_of(tok, case) -> str:
    assert case.tokens[0] == tok.eos_id  # the EOS every evaluated document starts with
    return tok.decode(case.tokens[1:])


def cases(tok, essay, task: str, length: int, n: int = 4, **settings):
    return make_cases(task, tok, length, n, seed=3, settings=Settings(**settings), prefix=[tok.eos_id], essay=essay)


# ----------------------------------------------------------------------------- the oracle


def context_of(text: str, start: str, end: str) -> str:
    """The text between the last `start` and the `end` after it."""
    i = text.rindex(start) + len(start)
    return text[i : text.index(end, i)]


def listed_words(text: str) -> list[str]:
    """The words of a CWE prompt's own numbered list (after its one-shot example); a last item cut
    inside its number is dropped."""
    listed = re.sub(r" \d+\.?$", "", context_of(text, "appear most often.\n", "\nQuestion:").strip())
    return re.split(r"(?:^| )\d+\. ", listed)[1:]


def oracle(task: str, text: str) -> str:
    """The right answer worked out from the prompt text alone, as a reader would."""
    kind = TASKS[task].kind
    if kind == "niah":
        query = re.search(r"magic \w+ for (.+) mentioned in the provided text\?", text).group(1)
        keys = query.replace(", and ", ", ").split(", ")
        found = {k: [] for k in keys}
        for _, key, value in NEEDLE.findall(text):
            if key in found:
                found[key].append(value)
        return ", ".join(v for k in keys for v in found[k])
    if kind == "vt":
        value = re.findall(r"assigned the value (\d+) in the text above", text)[-1]
        names = {a for a, v in VAR_VALUE.findall(text) if v == value}
        edges = VAR_VAR.findall(text)
        while True:
            more = {a for a, b in edges if b in names} - names
            if not more:
                return " ".join(sorted(names))
            names |= more
    if kind == "cwe":
        return " ".join(w for w, _ in Counter(listed_words(text)).most_common(10))
    listed = context_of(text, "coded words. ", "\nQuestion:").split(" ")
    return " ".join(w for w, _ in Counter(w for w in listed if w != "...").most_common(3))


@pytest.mark.parametrize("task", list(TASKS))
def test_an_oracle_reading_the_prompt_scores_one_on_every_task(tok, essay, task):
    for length in (1536, 3072):
        for case in cases(tok, essay, task, length, n=3):
            assert string_match(oracle(task, text_of(tok, case)), case.answers, TASKS[task].rule) == 1.0


# ----------------------------------------------------------------------------- chance


def candidates(task: str, text: str, rng: random.Random) -> list[str]:
    """What a guesser picks among: every needle value, variable name, listed word or coded word of
    the prompt, and 20 decoys of the same form (so that a one-needle task has a chance below 1)."""
    kind = TASKS[task].kind
    if kind == "niah":
        found = {v for _, _, v in NEEDLE.findall(text)}
        decoys = {needle(TASKS[task].value, rng) for _ in range(20)}
    elif kind == "vt":
        found = set(re.findall(r"VAR ([A-Z]{5})\b", text))
        decoys = set(variable_names(rng, 20, 5))
    elif kind == "cwe":
        found = set(listed_words(text))
        decoys = set(rng.sample(common_words(), 20))
    else:
        found = set(context_of(text, "coded words. ", "\nQuestion:").split(" ")) - {"..."}
        decoys = set(coded_words(rng, 20))
    return sorted(found | decoys)


def expected_chance(answers, pool: list[str], picks: int) -> float:
    """Exact mean score of `picks` distinct uniform guesses from `pool` under the `all` rule: an
    answer is found when a picked candidate contains it."""
    def p_found(a: str) -> float:
        holding = sum(a.lower() in c.lower() for c in pool)
        return 1 - math.comb(len(pool) - holding, picks) / math.comb(len(pool), picks)
    return sum(p_found(a) for a in answers) / len(answers)


@pytest.mark.parametrize("task", list(TASKS))
def test_a_random_answerer_scores_its_chance_level(tok, essay, task):
    rng = random.Random(0)
    scores, chances = [], []
    for case in cases(tok, essay, task, 2048, n=60, chains=2, fewshot=False):
        pool = candidates(task, text_of(tok, case), rng)
        picks = len(case.answers)
        guess = ", ".join(rng.sample(pool, picks))
        scores.append(string_match(guess, case.answers, "all"))
        chances.append(expected_chance(case.answers, pool, picks))
    mean, chance = sum(scores) / len(scores), sum(chances) / len(chances)
    spread = math.sqrt(sum(p * (1 - p) for p in chances)) / len(chances)
    assert abs(mean - chance) <= 4 * spread + 1e-9, (mean, chance)
    assert chance < 0.6  # guessing is not answering


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("task", list(TASKS))
def test_every_prompt_fills_its_length_exactly(tok, essay, task):
    for length in (1600, 2000, 8192):
        for case in cases(tok, essay, task, length, n=2):
            assert len(case.tokens) + case.budget == length
            assert case.budget == TASKS[task].budget
    for case in cases(tok, essay, task, 2000, n=2, budget=150):  # a budget of one's own, above every answer
        assert len(case.tokens) == 2000 - 150 and case.budget == 150


@pytest.mark.parametrize("task", [t for t, s in TASKS.items() if s.kind == "niah"])
def test_niah_prompts_follow_ruler(tok, essay, task):
    spec = TASKS[task]
    for case in cases(tok, essay, task, 2500):
        text = text_of(tok, case)
        singular = spec.queries * spec.values == 1
        kind = spec.value[:-1] if singular else spec.value
        assert text.startswith(f"{'A' if singular else 'Some'} special magic {kind} {'is' if singular else 'are'} "
                               f"hidden within the following text. Make sure to memorize it. I will quiz you about "
                               f"the {kind} afterwards.\n")
        assert text.endswith(f" mentioned in the provided text {'is' if singular else 'are'}")
        needles = NEEDLE.findall(text)
        query = re.search(r"for (.+) mentioned in the provided text\?", text).group(1).replace(", and ", ", ")
        asked = query.split(", ")
        assert len(asked) == spec.queries
        real = [n for n in needles if n[1] in set(asked) or n[2] in case.answers]
        keys = {k for _, k, _ in needles}
        if spec.haystack == "needle":  # the haystack is needles of other keys
            assert len(needles) == case.haystack + 1 and len(keys) == len(needles)
        else:
            assert len(needles) == max(spec.keys, spec.queries) * spec.values
            lines = text.split("\n")[1:-1] if spec.haystack == "noise" else []
            assert all(line == NOISE or NEEDLE.fullmatch(line) for line in lines[:-1])  # the last is cut short
        assert sorted(v for _, k, v in real) == sorted(case.answers)
        assert len(case.answers) == spec.queries * spec.values
        for _, key, value in needles:
            assert (re.fullmatch(r"\d{7}", value) if spec.value == "numbers" else UUID4.fullmatch(value))
            if spec.key == "uuids":
                assert UUID4.fullmatch(key)
            else:  # RULER's adjective-noun (either may hold a hyphen itself: x-rated, arm-rest)
                cuts = [i for i, ch in enumerate(key) if ch == "-"]
                assert any(key[:i] in word_list("adjectivelist.txt") and key[i + 1 :] in word_list("nounlist.txt")
                           for i in cuts)
        assert all(held_out(a) for a in case.answers)  # evaluation values only


def test_essay_needles_sit_in_the_corpus_text_read_in_order(tok, essay):
    text = " ".join(essay.sentences)
    for case in cases(tok, essay, "niah_multivalue", 3000):
        context = context_of(text_of(tok, case), "afterwards.\n", "\nWhat are")
        assert len(NEEDLE.findall(context)) == 4
        rest = re.sub(" +", " ", NEEDLE.sub("", context)).strip()
        kept = " ".join(text.split(" ")[: case.haystack])  # the corpus's first words, in order
        assert rest.startswith(kept)
        assert text[len(kept) :].strip().split(" ")[0].startswith(rest[len(kept) :].strip())  # then a word cut short


@pytest.mark.parametrize("hops, chains", [(4, 1), (2, 3)])
def test_variable_tracking_chains_have_the_asked_hops(tok, essay, hops, chains):
    for case in cases(tok, essay, "vt", 2500, hops=hops, chains=chains):
        text = text_of(tok, case)
        example, main = text.rsplit("Memorize and track", 1)
        if chains == 1:  # RULER's one-shot example, answered: its names in chain order
            assert example.endswith("they are:  " + " ".join(re.findall(r"VAR ([A-Z]{3}) = ", example)) + "\n\n")
        assert re.findall(r"\b[A-Z]{5}\b", main.split("Question:")[0])  # 5-letter names
        starts = VAR_VALUE.findall(main)
        links = VAR_VAR.findall(main)
        assert len(starts) == chains and len(links) == chains * hops
        lines = [line for line in main.split("\n") if line.startswith("VAR")]
        for name, value in starts:  # follow each chain in order of its lines: hop after hop
            chain = [name]
            for _ in range(hops):
                chain.append(next(a for a, b in links if b == chain[-1]))
            order = [next(i for i, line in enumerate(lines) if line.startswith(f"VAR {n} ")) for n in chain]
            assert order == sorted(order)
            if value in re.search(r"assigned the value (\d+)", main.split("Question:")[1]).group(1):
                assert tuple(chain) == case.answers
        assert f", {hops + 1} variables are assigned the value " in main and main.endswith(", they are: ")
        assert sum(line.endswith(" ") for line in lines) == chains * hops  # RULER's trailing space


@pytest.mark.parametrize("length, common, rare", [(2000, 6, 1), (8192, 30, 3)])
def test_common_words_counts_follow_ruler(tok, essay, length, common, rare):
    for case in cases(tok, essay, "cwe", length):
        text = text_of(tok, case)
        listed = context_of(text, "appear most often.\n", "\nQuestion:")
        items = re.findall(r"(?:^| )(\d+)\. ", listed)
        assert [int(i) for i in items] == list(range(1, len(items) + 1))  # numbered 1, 2, 3 ...
        counts = Counter(listed_words(text))  # the last item may be a word cut short: said once
        assert len(case.answers) == 10 and all(counts[w] == common for w in case.answers)
        assert max(c for w, c in counts.items() if w not in case.answers) <= rare
        assert text.count("Question: What are the 10 most common words in the above list?") == 2  # the example
        assert text.endswith("Answer: The top 10 words that appear most often in the list are:")


def example_items(tok, case) -> int:
    """The items of a CWE prompt's one-shot example list."""
    text = text_of(tok, case)
    example = text[: text.rindex("Below is a numbered list")]
    return len(re.findall(r"(?:^| )\d+\. ", context_of(example, "appear most often.\n", "\nQuestion:")))


def test_cwe_shrinks_its_example_where_rulers_long_one_leaves_no_room(tok, essay):
    """RULER's example: 40 words (10 x 10 + 30 x 3 items) from 4096 on, 20 (10 x 3 + 10 x 1) below.
    The session's tokenizer spends about twice RULER's tokens on a word: at 5000 the long example
    leaves no room and the short one is used, so that the curve has no hole."""
    assert [example_items(tok, c) for c in cases(tok, essay, "cwe", 8192, n=2)] == [190, 190]
    assert [example_items(tok, c) for c in cases(tok, essay, "cwe", 5000, n=2)] == [40, 40]
    assert [example_items(tok, c) for c in cases(tok, essay, "cwe", 3000, n=2)] == [40, 40]
    for case in cases(tok, essay, "cwe", 5000, n=2):  # RULER's counts for the length all the same
        counts = Counter(listed_words(text_of(tok, case)))
        assert all(counts[w] == 30 for w in case.answers) and len(counts) > 10


class OneTokenPerWord:
    """A tokenizer with one id per space-separated word (so a length of L tokens holds L words)."""

    eos_id = 0

    def __init__(self):
        self.words = ["<eos>"]
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        out = []
        for word in filter(None, text.split(" ")):
            if word not in self.ids:
                self.ids[word] = len(self.words)
                self.words.append(word)
            out.append(self.ids[word])
        return out

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def test_cwe_fills_128k_from_the_larger_word_list_past_wonderwords():
    """At 128K words the list needs about 21,600 distinct words, more than wonderwords' 8,166:
    as RULER does, every word (the common ones too) then comes from the larger list."""
    word_tok = OneTokenPerWord()
    (case,) = make_cases("cwe", word_tok, 131072, 1, seed=0, prefix=[word_tok.eos_id])
    assert len(case.tokens) + case.budget == 131072
    counts = Counter(listed_words(word_tok.decode(case.tokens[1:])))
    assert len(counts) > len(common_words()) and set(counts) <= set(large_word_list())
    assert all(counts[w] == 30 for w in case.answers)
    assert max(c for w, c in counts.items() if w not in case.answers) <= 3


def test_frequent_words_follow_rulers_zipf_counts(tok, essay):
    for case in cases(tok, essay, "fwe", 3000):
        text = text_of(tok, case)
        listed = context_of(text, "coded words. ", "\nQuestion:").split(" ")
        assert all(w == "..." or re.fullmatch(r"[a-z]{6}", w) for w in listed[:-1])  # the last may be cut short
        counts = Counter(listed)
        coded = [w for w in counts if re.fullmatch(r"[a-z]{6}", w)]
        vocab = (3000 - 50) // 50
        assert len(coded) <= vocab - 1
        ranked = sorted(coded, key=counts.__getitem__, reverse=True)
        assert set(ranked[:3]) == set(case.answers)
        expected = zipf_counts(sum(counts[w] for w in coded) + 10_000, vocab)  # shape only: rank order
        assert expected == sorted(expected, reverse=True)
        assert min(counts[w] for w in case.answers) > max(counts[w] for w in ranked[3:])


def test_zipf_counts_are_rulers_floors_with_the_tie_capped():
    zeta2 = math.pi**2 / 6
    assert zipf_counts(1000, 10)[:4] == [int(1000 * k**-2 / zeta2) for k in range(1, 5)]
    assert zipf_counts(45, 8)[4] < zipf_counts(45, 8)[3]  # 45 / (25 zeta) floors to 45 / (16 zeta)'s 1


def test_cases_differ_by_seed_and_repeat_for_a_seed(tok, essay):
    a = make_cases("niah_multikey_2", tok, 1500, 3, seed=1, prefix=[tok.eos_id])
    b = make_cases("niah_multikey_2", tok, 1500, 3, seed=1, prefix=[tok.eos_id])
    c = make_cases("niah_multikey_2", tok, 1500, 3, seed=2, prefix=[tok.eos_id])
    assert [x.tokens for x in a] == [x.tokens for x in b] and [x.answers for x in a] != [x.answers for x in c]


def test_essay_needles_sit_at_rulers_depths_counted_in_tokens(tok, essay):
    """Each needle of a code essay (sentences of 4 to hundreds of tokens) sits where its depth
    says in tokens: its recorded depth matches the re-tokenized text, and the depths are RULER's 40
    (0, 3, 5, ..., 100), drawn uniformly: each within a point of one, distributed as they are."""
    drawn = cases(tok, essay, "niah_single_2", 2048, n=200)
    depths = sorted(c.depths[0] for c in drawn)
    for case in drawn[:20]:
        context = context_of(text_of(tok, case), "afterwards.\n", "\nWhat is")
        found = NEEDLE.search(context)
        before, after = context[: found.start()], context[found.end() :]
        measured = 100 * len(tok.encode(before)) / (len(tok.encode(before)) + len(tok.encode(after)))
        assert abs(case.depths[0] - measured) <= 1.0, (case.depths, measured)
    assert all(min(abs(d - x) for x in DEPTHS) <= 1.0 for d in depths)  # by chance: 78% each
    steps = [(x + y) / 2 for x, y in zip(DEPTHS, DEPTHS[1:])]  # between RULER's depths: the CDFs compared
    gap = max(abs(sum(d <= s for d in depths) / len(depths) - (i + 1) / len(DEPTHS)) for i, s in enumerate(steps))
    assert gap < 1.95 / math.sqrt(len(depths)), gap  # Kolmogorov-Smirnov, alpha 0.001
    assert sum(d < 10 for d in depths) / len(depths) < 0.2  # the first tenth holds its share (4 of 40 depths)


@pytest.mark.parametrize("task", list(TASKS))
def test_no_budget_caps_an_oracle_silently(tok, essay, task):
    """A budget either holds every case's whole right answer, and an oracle saying it scores 1.0 on
    what the budget lets through, or is refused in one line naming the budget it needs."""
    passed, refused = [], []
    for budget in (None, 4, 8, 16, 24, 32, 48, 64, 96, 128):
        try:
            drawn = cases(tok, essay, task, 3072, n=3, budget=budget)
        except AnswerOverBudget as e:
            assert budget is not None and budget < e.needed and "\n" not in str(e)
            assert str(e).startswith(f"ruler.budget={budget} is shorter than {task}'s answers at length 3072")
            assert f"set ruler.budget >= {e.needed} or null" in str(e)
            refused.append(budget)
            continue
        for case in drawn:
            said = tok.decode(tok.encode(case.continuation)[: case.budget])
            assert string_match(postprocess(said), case.answers, TASKS[task].rule) == 1.0
        passed.append(budget)
    assert None in passed and 128 in passed and 4 in refused


# ----------------------------------------------------------------------------- refusals


def test_a_length_below_the_prompt_is_one_clear_error(tok, essay):
    with pytest.raises(TooShort, match="niah_single_1 at length 150: .* take [0-9]+ tokens"):
        cases(tok, essay, "niah_single_1", 150)
    with pytest.raises(ValueError, match="unknown RULER task 'qa_1'"):
        make_cases("qa_1", tok, 4096, 1, seed=0)
    with pytest.raises(ValueError, match="cases=0 must be >= 1"):
        make_cases("vt", tok, 4096, 0, seed=0)


def test_an_essay_corpus_too_short_is_refused(tmp_path):
    (tmp_path / "tiny.txt").write_text("A short essay. It has a few words only.")
    cfg = DataConfig(sources=[SourceConfig(kind="files", path=str(tmp_path / "tiny.txt"))])
    with pytest.raises(ValueError, match="the essay haystack needs 4096 words of text; .* hold 9"):
        read_essay(cfg, 4096, whole=True)


def test_sentences_are_cut_at_stops_and_at_fifty_words():
    assert sentences_of("One two.  Three\nfour! Five") == ["One two.", "Three four!", "Five"]
    long = sentences_of(" ".join(["w"] * 120) + ".")
    assert [len(s.split(" ")) for s in long] == [50, 50, 20]


# ----------------------------------------------------------------------------- scoring


@pytest.mark.parametrize("prediction, answers, rule, score", [
    ("The numbers are 1234567 and 7654321.", ["1234567", "7654321"], "all", 1.0),
    ("The numbers are 1234567 and 7654320.", ["1234567", "7654321"], "all", 0.5),
    ("nothing here", ["1234567", "7654321"], "all", 0.0),
    ("ABCDE fghij", ["abcde", "FGHIJ", "KLMNO", "PQRST"], "all", 0.5),  # case-insensitive
    ("The numbers are 1234567 and 7654320.", ["1234567", "7654321"], "part", 1.0),
    ("nothing here", ["1234567", "7654321"], "part", 0.0),
    ("x12345678", ["1234567"], "all", 1.0),  # a substring counts, as in RULER
])
def test_the_scorer_follows_rulers_all_and_part_rules(prediction, answers, rule, score):
    assert string_match(prediction, answers, rule) == score


def test_predictions_are_postprocessed_as_ruler_does():
    assert postprocess("  1. cat\t2. dog\x00\n ") == "1. cat\n2. dog"
    with pytest.raises(ValueError, match="rule 'any'"):
        string_match("x", ["x"], "any")


def test_cell_interval_covers_the_mean_and_stays_in_range():
    low, high = cell_interval([1.0] * 15 + [0.0] * 5)
    assert 0.5 < low < 0.75 < high <= 1.0
    assert cell_interval([1.0] * 10) == (1.0, 1.0)


# ----------------------------------------------------------------------------- training rows


@pytest.mark.parametrize("task, kw", [("niah_multikey_2", {}), ("vt", {"hops": 2})])
def test_training_rows_are_the_evaluation_prompt_with_its_answer(tok, task, kw):
    src = SourceConfig(kind="synthetic", task=task, loss_on="answer", **kw)
    cursor = SyntheticCursor(src, tok, seed=1, rank=0, worker=0)
    for _ in range(5):
        block = cursor.next_block(1024)
        ids = [t if t >= 0 else -t - 1 for t in block.tolist()]  # untrained positions are stored as -(id + 1)
        trained = [t for t in block.tolist() if t >= 0]  # loss_on: answer: the answer alone
        text = tok.decode([t for t in ids if t != tok.eos_id])
        answer = tok.decode(trained)
        if task == "vt":
            names = answer.split(" ")
            assert len(names) == 3 and text.endswith("they are: " + answer)  # 2 hops: 3 names
            assert oracle("vt", text[: -len(answer)]) == " ".join(sorted(names))
        else:
            assert answer == " " + oracle(task, text[: -len(answer)]) + "."
            assert not held_out(answer.strip(" ."))  # training values only
