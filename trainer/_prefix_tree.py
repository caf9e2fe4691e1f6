"""Samples laid as one prefix tree: every prefix they share is forwarded once.

Samples often start alike: the samples of a GRPO group share their prompt, and so do the samples
one trajectory splits into when its template re-renders earlier turns (a reasoning template drops
their thinking, so each call's prompt extends the previous *prompt* but not its sampled ids: call
k's sample holds prompt k, and every later sample starts with prompt k too). Forwarded alone, each
such sample computes the shared prefix again, a cost that grows with the square of the turns.

A token's hidden state depends only on the tokens before it in its own sample (causal attention,
positions counted from the sample's start). So a prefix that several samples share computes the
same states for each: laid once, with each token attending to the tokens on its own path and no
other, every sample is scored exactly as alone. The row is the tree of the samples' token ids in
depth-first order, cut into *segments*: runs in which each token follows the one before it in its
sample. A segment starts at the root or forks after an earlier token of the row::

    samples  a b c d e       row       a b c d e x y f g
             a b c x y       segments  [a b c d e]       from the root
             a b f g                   [x y]  after c   (keys: a b c, then x y)
                                       [f g]  after b   (keys: a b, then f g)

``trainer._logprobs.pack_row`` gives the attention kernel those paths as a mask (sdpa, eager: token
i sees token j iff j is on i's path) or as one variable-length sequence per segment whose keys are
its path (flash attention, ``trainer._attention``). ``pack_tree`` fills micro-batches so that
samples sharing a prefix go together, each costed at what it adds to the tree.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of the row ``[start, end)`` whose tokens each follow the one before; ``fork`` precedes ``start``."""

    start: int
    end: int
    fork: int  # the row index of the token before ``start`` in its samples; -1 when the segment starts a sample


@dataclass(frozen=True, slots=True)
class TreeLayout:
    """Where each token of each sample sits in one row."""

    ids: list[int]  # (T,) the row's token ids
    positions: list[int]  # (T,) each row token's position in its sample(s)
    where: list[list[int]]  # per sample, in the caller's order: the row index of each of its tokens
    segments: list[Segment]  # the row cut into runs, in row order

    @property
    def shared(self) -> bool:
        """Whether some token stands for several samples (the row is shorter than the samples end to end)."""
        return len(self.ids) < sum(len(w) for w in self.where)

    def keys(self, segment: Segment) -> list[int]:
        """The row indices a segment's tokens attend to: its path from the root to ``fork``, then itself."""
        runs: list[range] = [range(segment.start, segment.end)]
        fork = segment.fork
        while fork >= 0:
            parent = self._segment_of(fork)
            runs.append(range(parent.start, fork + 1))
            fork = parent.fork
        return [i for run in reversed(runs) for i in run]

    def _segment_of(self, index: int) -> Segment:
        lo, hi = 0, len(self.segments) - 1
        while lo < hi:  # the last segment starting at or before index
            mid = (lo + hi + 1) // 2
            if self.segments[mid].start <= index:
                lo = mid
            else:
                hi = mid - 1
        return self.segments[lo]


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share.

    Slices are compared in C, over doubling lengths and then by halving: O(k log k) for a shared
    prefix of k tokens, so two samples that share nothing cost two small comparisons.
    """
    limit = min(len(a), len(b))
    lo, hi = 0, 1  # a[:lo] == b[:lo]; hi: the next length to try
    while hi <= limit and a[lo:hi] == b[lo:hi]:
        lo, hi = hi, 2 * hi
    hi = min(hi, limit + 1) - 1  # a[:hi + 1] differs, or hi is the whole of the shorter
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def lay_out(samples: Sequence[Sequence[int]], *, share: bool = True) -> TreeLayout:
    """The row for ``samples`` (token id lists): their prefix tree if ``share``, else each laid whole, end to end.

    >>> layout = lay_out([[1, 2, 3, 4, 5], [1, 2, 3, 8, 9], [1, 2, 6, 7]])
    >>> layout.ids, layout.where[2]
    ([1, 2, 3, 4, 5, 8, 9, 6, 7], [0, 1, 7, 8])
    >>> [(s.start, s.end, s.fork) for s in layout.segments], layout.keys(layout.segments[2])
    ([(0, 5, -1), (5, 7, 2), (7, 9, 1)], [0, 1, 7, 8])
    """
    lists = [list(s) for s in samples]  # compared as lists: a list never equals a tuple
    order = sorted(range(len(lists)), key=lists.__getitem__) if share else list(range(len(lists)))
    ids: list[int] = []
    positions: list[int] = []
    where: list[list[int]] = [[] for _ in lists]
    segments: list[Segment] = []
    previous: int | None = None
    for i in order:
        tokens = lists[i]
        # Sorted, the sample before shares the longest prefix with this one of all those already laid.
        depth = shared_prefix(lists[previous], tokens) if share and previous is not None else 0
        path = where[previous][:depth] if previous is not None else []
        fork = path[-1] if path else -1
        start = len(ids)
        if depth < len(tokens):
            ids += tokens[depth:]
            positions += range(depth, len(tokens))
            if segments and fork == start - 1 and fork >= 0:  # continues the row's last token: same segment
                segments[-1] = Segment(segments[-1].start, len(ids), segments[-1].fork)
            else:
                segments.append(Segment(start, len(ids), fork))
        where[i] = path + list(range(start, len(ids)))
        previous = i
    return TreeLayout(ids, positions, where, segments)


def tree_tokens(samples: Sequence[Sequence[int]]) -> int:
    """How many tokens the prefix tree of ``samples`` holds: what laying them in one row forwards.

    >>> tree_tokens([[1, 2, 3], [1, 2, 4], [5]])
    5
    """
    ordered = sorted(list(s) for s in samples)
    return sum(len(s) - (shared_prefix(ordered[k - 1], s) if k else 0) for k, s in enumerate(ordered))


def pack_tree(samples: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Micro-batches of sample indices whose prefix tree holds at most ``max_tokens`` tokens each.

    First-fit decreasing, costed by the tree: longest samples first, each into the micro-batch to
    which it adds the fewest tokens (its length minus the longest prefix it shares with a sample
    already there; the first such micro-batch on a tie), among those with room; else into a new
    one. So the samples of a GRPO group, or the split samples of one trajectory, gather where their
    prefix already is, and unrelated samples fill what room is left. A sample longer than
    ``max_tokens`` gets a micro-batch of its own. Indices within a micro-batch are ascending; the
    result is deterministic.

    >>> pack_tree([[7, 7, 1], [9, 3], [7, 7, 2]], 4)
    [[0, 2], [1]]
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    lists = [list(s) for s in samples]
    bins: list[list[int]] = []
    room: list[int] = []
    held: list[list[list[int]]] = []  # each micro-batch's samples in token order: the best match is a neighbour
    for i in sorted(range(len(lists)), key=lambda i: -len(lists[i])):  # stable: ties keep input order
        tokens = lists[i]
        best, adds = None, len(tokens)
        for b, members in enumerate(held):
            at = bisect.bisect_left(members, tokens)
            shared = max((shared_prefix(members[j], tokens) for j in (at - 1, at) if 0 <= j < len(members)), default=0)
            if len(tokens) - shared <= room[b] and (best is None or len(tokens) - shared < adds):
                best, adds = b, len(tokens) - shared
        if best is None:
            bins.append([])
            held.append([])
            room.append(max_tokens)
            best = len(bins) - 1
        bins[best].append(i)
        bisect.insort(held[best], tokens)
        room[best] -= adds
    return [sorted(b) for b in bins]
