"""Enumerated prefill lengths: for targets whose prefill entry points are traced at fixed prompt lengths (Apple's:
one function per length, since their converters take no loop over a dynamic number of chunks). A prompt is fed as
pieces of those lengths, largest first, and its tail by step. Torch-free: runners import it."""

from __future__ import annotations

from edgelin.errors import EdgelinError

DEFAULT_LENGTHS = (16, 64)
MAX_LENGTH = 2048


def pieces(length: int, lengths: list[int]) -> list[int]:
    """How a prompt of `length` tokens is fed: the enumerated prefill lengths, largest first, then 1s
    (steps) for the tail: pieces(15, [4, 16]) -> [4, 4, 4, 1, 1, 1]."""
    out, left = [], length
    for size in sorted(lengths, reverse=True):
        while left >= size:
            out.append(size)
            left -= size
    return out + [1] * left


def parse_lengths(text: str | None) -> tuple[int, ...]:
    """--prefill-lengths 16,64 -> (16, 64), sorted and unique; None: the default. One line for anything else."""
    if text is None:
        return DEFAULT_LENGTHS
    try:
        lengths = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        lengths = ()
    return checked_lengths(lengths, text)


def checked_lengths(lengths: tuple[int, ...] | list[int], given: object = None) -> tuple[int, ...]:
    if (not isinstance(lengths, (tuple, list)) or not lengths
            or not all(isinstance(n, int) and not isinstance(n, bool) and 2 <= n <= MAX_LENGTH for n in lengths)):
        raise EdgelinError(f"--prefill-lengths {given if given is not None else lengths}",
                           f"it takes comma-separated prompt lengths in 2..{MAX_LENGTH} (one prefill entry point "
                           "each; a single token runs on step)", "pass e.g. --prefill-lengths 16,64")
    return tuple(sorted(set(lengths)))
