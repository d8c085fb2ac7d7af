"""RULER's haystacks: the noise paragraph, and essays from a local text corpus.

RULER's `noise` haystack repeats the passkey paper's five filler sentences as one paragraph per
line; its `essay` haystack is Paul Graham's essays with whitespace collapsed, cut into sentences
(NLTK's punkt), the needles put between sentences at chosen depths. Here an essay haystack is read
from any local text corpus the data config names (by default the held-out standard-library
documents), so no download is needed: the documents of a split, in the source's seeded order,
whitespace collapsed as RULER does, cut into sentences at `.`, `!` or `?` followed by a space
(punkt needs a download), and a sentence longer than `MAX_SENTENCE_WORDS` words (source code has
few full stops) cut into pieces of that many. As in RULER, a haystack of n units is the essays'
first n words (`Essay.first`): whole sentences, then the next one cut after its last word that fits.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property

from data.config import DataConfig
from data.sources import open_source, text_of

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
MAX_SENTENCE_WORDS = 50
_SENTENCE_END = re.compile(r"(?<=[.!?]) ")


@dataclass(frozen=True)
class Essay:
    """An essay haystack: sentences in reading order, and where they came from."""

    sentences: tuple[str, ...]
    source: str

    @cached_property
    def ends(self) -> tuple[int, ...]:
        """The words read by the end of each sentence."""
        out, total = [], 0
        for sentence in self.sentences:
            total += len(sentence.split(" "))
            out.append(total)
        return tuple(out)

    @property
    def words(self) -> int:
        return self.ends[-1] if self.ends else 0

    def first(self, n: int) -> tuple[list[str], list[str]]:
        """The sentences of the first `n` words (the last one cut short where `n` ends inside it),
        and the text after them as sentences (the cut one's rest first); `IndexError` past the end."""
        if n >= self.words:
            raise IndexError(n)
        whole = bisect_right(self.ends, n)
        left = n - (self.ends[whole - 1] if whole else 0)
        units, rest = list(self.sentences[:whole]), list(self.sentences[whole:])
        if left:
            cut = rest[0].split(" ")
            units.append(" ".join(cut[:left]))
            rest[0] = " ".join(cut[left:])
        return units, rest


def sentences_of(text: str) -> list[str]:
    """`text` with whitespace collapsed, cut into sentences of at most `MAX_SENTENCE_WORDS` words."""
    out = []
    for sentence in _SENTENCE_END.split(re.sub(r"\s+", " ", text).strip()):
        words = sentence.split(" ")
        out += [" ".join(words[i : i + MAX_SENTENCE_WORDS]) for i in range(0, len(words), MAX_SENTENCE_WORDS)]
    return [s for s in out if s]


def read_essay(cfg: DataConfig, min_words: int, split: str = "test", seed: int = 0, whole: bool = False) -> Essay:
    """At least `min_words` words of the corpus's text sources (documents of `split`, in order), or a
    `ValueError` saying how many it has (a setting to change: the corpus or the lengths). A token
    holds at most one word here (tokenizers split at spaces), so `min_words` = the longest prompt's
    tokens always suffices."""
    sentences: list[str] = []
    words = 0
    names = ", ".join(s.describe() for s in cfg.sources if s.is_text)
    for src in cfg.sources:
        if not src.is_text:
            continue
        for example in open_source(src, split, cfg, seed=seed, whole=whole):
            for sentence in sentences_of(text_of(example, src)):
                sentences.append(sentence)
                words += len(sentence.split(" "))
            if words >= min_words:
                return Essay(tuple(sentences), f"{names} ({split})")
    raise ValueError(f"the essay haystack needs {min_words} words of text; sources {names or '(none)'} "
                    f"hold {words} in split {split!r}: name a larger corpus with sources=")
