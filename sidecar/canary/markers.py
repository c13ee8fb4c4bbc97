"""Marker texts for the victim tenant, filler for the prober tenant, and the overlap search.

Victim (A) prompts are a per-request header followed by a body of marker blocks
``#<run><block><random>`` (uppercase letters and digits, ``|``-separated). The body
is the same text in every A request of a run, at the same positions: a model that
copies what it attends to (the echo model copies the token ``L`` positions back)
then reads the same character from whichever stale A page holds a position, so
several stale copies of one position do not scramble the marker. The header
differs per request so that A requests share no prefix-cache pages and really fill
the KV pool.

Prober (B) prompts use only lowercase words and spaces, so no run of A's marker
characters can come from B's own prompt. A leak is a run of at least
``min_overlap`` characters of A's text in B's output, compared after removing
everything but letters and digits (a model may space or split a marker across
tokens differently from how it was sent).
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field

DEFAULT_MIN_OVERLAP = 10  # characters; a chance match of 10 marker characters is ~36**-10
MARKER_ALPHABET = string.ascii_uppercase + string.digits
BLOCK_RANDOM = 8
_B_WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "while",
    "river",
    "stone",
    "paper",
    "window",
    "garden",
    "yellow",
    "silent",
    "market",
    "orange",
    "travel",
    "summer",
)
_NOT_ALNUM = re.compile(r"[^A-Za-z0-9]")


def normalize(text: str) -> str:
    return _NOT_ALNUM.sub("", text)


@dataclass
class MarkerSet:
    """The run's marker blocks and the victim texts built from them."""

    run_id: str
    blocks: list[str]  # "#" + run_id + block index (2, base 36) + random
    headers: list[str] = field(default_factory=list)  # "[<run> aNNN]" of each victim request made

    @classmethod
    def new(cls, rng: random.Random, n_blocks: int = 400) -> MarkerSet:
        run_id = "".join(rng.choice(string.ascii_uppercase) for _ in range(4))
        blocks = []
        for i in range(n_blocks):
            idx = _base36(i).rjust(2, "0")
            blocks.append(f"#{run_id}{idx}" + "".join(rng.choice(MARKER_ALPHABET) for _ in range(BLOCK_RANDOM)))
        return cls(run_id, blocks)

    def body(self, chars: int) -> str:
        """The shared victim body, ``chars`` long (blocks joined by ``|``, cycled if needed)."""
        text = "|".join(self.blocks) + "|"
        while len(text) < chars:
            text += text
        return text[:chars]

    def victim_text(self, request_no: int, chars: int, prefix: str = "") -> str:
        """An A prompt of ``chars`` characters: ``prefix``, a per-request header, then the
        body, aligned so that position q holds body[q] in every A request of the run."""
        header = f"[{self.run_id} a{request_no:03d}]"
        if header not in self.headers:
            self.headers.append(header)
        head = prefix + header + " "
        return (head + self.body(chars)[len(head) :])[:chars]

    def blocks_in(self, fragment: str) -> list[str]:
        """The markers a (normalized) fragment of A's text holds: request headers it
        contains whole, and body blocks it shares at least 6 characters with."""
        hits = [h for h in self.headers if normalize(h) in fragment]
        for b in self.blocks:
            nb = normalize(b)
            if _overlap(nb, fragment) >= min(6, len(nb)):
                hits.append(b)
        return hits


def _base36(n: int) -> str:
    digits = string.digits + string.ascii_uppercase
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _overlap(block: str, fragment: str) -> int:
    """Length of the longest substring the two share (small inputs)."""
    return len(longest_common_substring(block, fragment))


def filler_text(chars: int, rng: random.Random, prefix: str = "") -> str:
    """A B prompt: ``prefix`` then lowercase words to ``chars`` characters."""
    words = [prefix] if prefix else []
    n = len(prefix)
    while n < chars:
        w = rng.choice(_B_WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:chars]


def longest_common_substring(a: str, b: str) -> str:
    """The longest string that is a substring of both (dynamic programming, O(len a * len b))."""
    if not a or not b:
        return ""
    best_len, best_end = 0, 0
    prev = [0] * (len(b) + 1)
    for i in range(1, len(a) + 1):
        cur = [0] * (len(b) + 1)
        ai = a[i - 1]
        for j in range(1, len(b) + 1):
            if ai == b[j - 1]:
                cur[j] = prev[j - 1] + 1
                if cur[j] > best_len:
                    best_len, best_end = cur[j], i
        prev = cur
    return a[best_end - best_len : best_end]


@dataclass
class Leak:
    """A run of victim text found in a prober output."""

    fragment: str  # normalized characters, as found in the output
    blocks: list[str]  # the marker blocks it overlaps
    victims: list[int]  # the A requests whose prompt holds it (indexes into the victim prompts given)


def longest_shared_run(out: str, text: str, min_len: int, exclude: str = "") -> str:
    """The longest substring of ``out`` (at least ``min_len`` long) that occurs in ``text``
    and not in ``exclude``; "" when none. Window tests use ``in`` (C speed): outputs are
    short, victim texts long."""
    best = ""
    for i in range(len(out) - min_len + 1):
        if len(out) - i <= len(best):
            break
        n = max(min_len, len(best) + 1)
        if out[i : i + n] not in text:
            continue
        while i + n < len(out) and out[i : i + n + 1] in text:
            n += 1
        frag = out[i : i + n]
        if exclude and frag in exclude:
            continue
        best = frag
    return best


def find_leak(
    output: str, own_prompt: str, victim_prompts: list[str], markers: MarkerSet, min_overlap: int = DEFAULT_MIN_OVERLAP
) -> Leak | None:
    """A's text in B's ``output``: the longest run of at least ``min_overlap`` letters and
    digits shared with a victim prompt and not also in B's ``own_prompt``; None if none."""
    victims = [normalize(p) for p in victim_prompts]
    best = longest_shared_run(normalize(output), "\0".join(victims), min_overlap, normalize(own_prompt))
    if not best:
        return None
    return Leak(best, markers.blocks_in(best), [i for i, v in enumerate(victims) if best in v])
