"""The random needles of RULER's tasks: keys and values as numbers, words or UUIDs, variable names,
the common-words list and the coded words of frequent-words extraction.

Words come from the word lists RULER reads (the `wonderwords` package: nouns, adjectives, verbs);
a `words` needle is RULER's `adjective-noun`, drawn as an adjective and a noun (RULER samples the
sorted set of their pairs: the same distribution, without building millions of strings). Where
common-words extraction needs more distinct words than those 8,166, RULER draws them all from a
larger English list (its `english_words.json`, a download); here the `english-words` package's
web2 list, lowercased (234,450 words), installed offline like wonderwords.
"""

from __future__ import annotations

import random
import string
import uuid
from functools import cache

NEEDLE_KINDS = ("numbers", "words", "uuids")


@cache
def word_list(name: str) -> tuple[str, ...]:
    """One of wonderwords' lists (`nounlist.txt`, `adjectivelist.txt`, `verblist.txt`), as RULER reads it."""
    from wonderwords.random_word import _get_words_from_text_file

    return tuple(_get_words_from_text_file(name))


@cache
def common_words() -> tuple[str, ...]:
    """Common-words extraction's vocabulary: nouns, adjectives and verbs, deduplicated and sorted."""
    return tuple(sorted(set(word_list("nounlist.txt") + word_list("adjectivelist.txt") + word_list("verblist.txt"))))


@cache
def large_word_list() -> tuple[str, ...]:
    """The larger list common-words extraction switches to past `common_words()`, sorted."""
    from english_words import get_english_words_set

    return tuple(sorted(get_english_words_set(["web2"], lower=True)))


def needle(kind: str, rng: random.Random) -> str:
    """A key or value: a 7-digit number, an `adjective-noun` word or a version-4 UUID."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return f"{rng.choice(word_list('adjectivelist.txt'))}-{rng.choice(word_list('nounlist.txt'))}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle kind {kind!r} is not one of {', '.join(NEEDLE_KINDS)}")


def variable_names(rng: random.Random, n: int, letters: int) -> list[str]:
    """`n` distinct names of `letters` uppercase letters (variable tracking's `VAR` names)."""
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    return names


def coded_words(rng: random.Random, n: int, letters: int = 6) -> list[str]:
    """`n` distinct random lowercase words of `letters` letters (frequent-words extraction's code)."""
    words: set[str] = set()
    while len(words) < n:
        words.add("".join(rng.choices(string.ascii_lowercase, k=letters)))
    out = sorted(words)
    rng.shuffle(out)
    return out
