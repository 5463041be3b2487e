"""A tiny, deterministic training set: arithmetic sentences, characters as tokens.

Nothing is downloaded and no data file is shipped: the text is generated on the
fly from a seed, e.g.

    17+25=42.
    6*7=42.
    the sum of 3 and 4 is 7.

It is easy enough that the toy GPT in ``parlab.models`` visibly learns it in a
few hundred steps on a CPU, and structured enough (digits must add up) that the
loss keeps falling for a while.

* ``CharTokenizer``: a fixed alphabet of 43 characters (fits GPTConfig's vocab 64).
* ``load_corpus(n_chars, seed)``: the whole corpus as one 1-D tensor of token ids.
* ``BatchSampler``: the global batch of any step, deterministic in (seed, step),
  and the slice of it that data-parallel rank r of w gets.
* ``micro_batches``: split a batch into equal micro-batches (gradient
  accumulation, pipeline schedules).
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Iterable

import torch

__all__ = ["ALPHABET", "CharTokenizer", "make_text", "load_corpus", "BatchSampler", "micro_batches"]

ALPHABET = "\n .+-*=0123456789abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """One token per character of a fixed alphabet; the token id is the character's index."""

    def __init__(self, alphabet: str = ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("CharTokenizer alphabet has repeated characters")
        self.alphabet = alphabet
        self.stoi = {ch: i for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[ch] for ch in text]
        except KeyError as err:
            raise ValueError(f"character {err.args[0]!r} is not in the tokenizer alphabet {self.alphabet!r}") from None

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.alphabet[int(i)] for i in ids)


def _sentence(rng: random.Random) -> str:
    """One random arithmetic sentence, ending in '.'."""
    a, b = rng.randrange(100), rng.randrange(100)
    kind = rng.randrange(4)
    if kind == 0:
        return f"{a}+{b}={a + b}."
    if kind == 1:
        a, b = max(a, b), min(a, b)  # keep results non-negative
        return f"{a}-{b}={a - b}."
    if kind == 2:
        a, b = a % 13, b % 13  # small times tables
        return f"{a}*{b}={a * b}."
    return f"the sum of {a} and {b} is {a + b}."


@functools.lru_cache(maxsize=8)
def make_text(n_chars: int = 200_000, seed: int = 0) -> str:
    """Exactly ``n_chars`` characters of newline-separated sentences, deterministic in ``seed``."""
    if n_chars < 1:
        raise ValueError(f"n_chars must be positive, got {n_chars}")
    rng = random.Random(seed)  # Python's Mersenne Twister: same text on every platform
    lines: list[str] = []
    length = 0
    while length < n_chars:
        line = _sentence(rng)
        lines.append(line)
        length += len(line) + 1
    return "\n".join(lines)[:n_chars]


def load_corpus(n_chars: int = 200_000, seed: int = 0) -> torch.Tensor:
    """The corpus as token ids: a 1-D LongTensor of length ``n_chars``."""
    return torch.tensor(CharTokenizer().encode(make_text(n_chars, seed)), dtype=torch.long)  # (n_chars,)


def _mix(*values: int) -> int:
    """A generator seed from several integers. 32 bits, because the CPU generator
    (mt19937) keeps only the low 32 bits of a seed."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class BatchSampler:
    """Random windows of a token stream; the same global batch for a step on every rank.

    ``global_batch(step)`` draws ``batch_size`` start offsets from a generator seeded
    by (seed, step), so any process can recompute the batch of any step without
    communication. ``shard(step, rank, world_size)`` is the contiguous block of rows
    rank ``rank`` gets under data parallelism. Because every shard has the same
    number of rows, the mean of the per-shard mean losses equals the global mean loss.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0) -> None:
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor of ids, got shape {tuple(tokens.shape)}")
        for name, v in (("batch_size", batch_size), ("seq_len", seq_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if tokens.numel() < seq_len + 1:
            raise ValueError(f"need at least seq_len + 1 = {seq_len + 1} tokens, got {tokens.numel()}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (batch_size, seq_len) long; y[:, t] = x[:, t + 1] in the corpus."""
        g = torch.Generator().manual_seed(_mix(self.seed, step))
        n_starts = self.tokens.numel() - self.seq_len  # a window needs seq_len + 1 tokens
        starts = torch.randint(n_starts, (self.batch_size,), generator=g)  # (B,)
        idx = starts[:, None] + torch.arange(self.seq_len)  # (B, S)
        idx = idx.to(self.tokens.device)
        return self.tokens[idx], self.tokens[idx + 1]  # (B, S), (B, S)

    def shard(self, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [rank * b, (rank + 1) * b) of ``global_batch(step)``, b = batch_size // world_size, as tensors of
        their own: a data-parallel rank holds its slice only (a view would keep the whole batch's storage alive, and
        a memory count by storage would charge each rank the global batch)."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if self.batch_size % world_size != 0:
            raise ValueError(
                f"global batch {self.batch_size} is not divisible by {world_size} data-parallel ranks; "
                f"every rank must get the same number of rows, so use a batch_size that is a multiple "
                f"of {world_size} (e.g. {world_size * max(1, self.batch_size // world_size)})"
            )
        b = self.batch_size // world_size
        x, y = self.global_batch(step)  # (B, S), (B, S)
        return x[rank * b : (rank + 1) * b].clone(), y[rank * b : (rank + 1) * b].clone()  # (b, S), (b, S)


def micro_batches(x: torch.Tensor, y: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split (x, y), each (B, S), into ``n`` micro-batches of B // n rows, in order."""
    B = x.shape[0]
    if y.shape[0] != B:
        raise ValueError(f"x and y have different batch sizes: {B} and {y.shape[0]}")
    if n < 1 or B % n != 0:
        raise ValueError(
            f"a batch of {B} rows cannot be split into {n} equal micro-batches; "
            f"pick a number of micro-batches that divides {B}"
        )
    m = B // n
    return [(x[i * m : (i + 1) * m], y[i * m : (i + 1) * m]) for i in range(n)]  # n x ((m, S), (m, S))
