"""Visual-token merging: which neighbouring tokens of an image become one (transformers engine only).

Pruning drops tokens; merging keeps what they carry by averaging similar neighbours, so the
same budget covers more of the image. The rule, per image:

* neighbours are ADJACENT tokens in a row of the image's token grid (row-major order, as the
  tower emits them); the last token of a grid row and the first of the next are not neighbours,
  nor are tokens of two Idefics3 tiles (the adapter's ``token_rows`` says where rows end);
* the pair of neighbouring runs with the highest cosine similarity of their mean embeddings is
  merged, greedily, until ``kept_count(n, keep)`` runs remain (ties go to the leftmost pair, so
  the result is deterministic); a run never spans two grid rows, so a grid of R rows never
  merges below R tokens;
* a run becomes ONE token: the average of its members' embeddings (and of every extra per-token
  output, e.g. Qwen3-VL's deepstack features, over the same members).

Where the merged token sits: at the position of the run's MIDDLE member (the left one of the
two middle members of an even run); ``worker.tokens.reduction`` keeps that member's column
with its original position and drops the others'. Why: positions must be whole numbers (the
rotary tables and the causal mask take integer ids), so the run's centroid column, which is what
an average of its patches depicts, is rounded to the member nearest it. That position is a real
cell of the image's grid in the merged token's own row (M-RoPE's height and time components are
unchanged; its width component is inside the run), distinct from every other kept token's,
and in the same raster order as the tokens around it, so M-RoPE sees a consistent, sparser
image; the text after the image keeps its own positions, and decoding continues exactly where
the full-token run does. Taking the run's first member instead would shift every merged patch
half a run to the left.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from worker.tokens.pruning import kept_count

EPS = 1e-12


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), EPS))


def merge_runs(embeds: torch.Tensor, rows: list[int], keep: float) -> list[tuple[int, int]]:
    """Runs [start, end) of token indices, in order, that each become one token.

    ``rows``: lengths of the grid's rows in token order (they sum to the token count).
    """
    n = int(embeds.shape[0])
    if sum(rows) != n or any(r < 1 for r in rows):
        raise ValueError(f"grid rows {rows[:4]}... do not cover {n} tokens")
    target = kept_count(n, keep)
    if target >= n:
        return [(i, i + 1) for i in range(n)]
    # Sums, not means: the cosine of two runs' sums is the cosine of their means. float64 so
    # that the order of additions cannot flip a comparison between runs.
    sums = embeds.detach().to("cpu", torch.float64).numpy().copy()
    end = np.arange(1, n + 1)
    nxt = np.arange(1, n + 1)
    prev = np.arange(-1, n - 1)
    at = 0
    for length in rows:  # no neighbours across a grid row's end
        prev[at] = -1
        nxt[at + length - 1] = -1
        at += length
    version = np.zeros(n, dtype=np.int64)
    alive = np.ones(n, dtype=bool)
    heap: list[tuple[float, int, int, int, int]] = []

    def push(left: int, right: int) -> None:
        heapq.heappush(
            heap, (-_cosine(sums[left], sums[right]), left, int(version[left]), right, int(version[right]))
        )

    for left in range(n):
        if nxt[left] != -1:
            push(left, int(nxt[left]))
    count = n
    while count > target and heap:
        _, left, v_left, right, v_right = heapq.heappop(heap)
        if not (alive[left] and alive[right]) or version[left] != v_left or version[right] != v_right:
            continue  # a stale pair: one side has merged since
        sums[left] += sums[right]
        end[left] = end[right]
        alive[right] = False
        nxt[left] = nxt[right]
        if nxt[left] != -1:
            prev[nxt[left]] = left
        version[left] += 1
        count -= 1
        if prev[left] != -1:
            push(int(prev[left]), left)
        if nxt[left] != -1:
            push(left, int(nxt[left]))
    return [(int(s), int(end[s])) for s in np.flatnonzero(alive)]


def run_position(start: int, end: int) -> int:
    """The member of run [start, end) whose column (and position) the merged token takes."""
    return start + (end - start - 1) // 2
