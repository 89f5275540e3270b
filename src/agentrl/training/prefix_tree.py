"""Shared token prefixes of a micro-batch as a forest, and the forward layout it gives.

The samples of a GRPO group start with the same prompt (system prompt, tool schemas, question), and branches of one
trajectory also share their first turns. ``build_forest`` finds these spans from the token ids alone: it sorts the
samples lexicographically (samples with a common prefix become neighbours) and reads the longest common prefix of
neighbours, so no pair is compared twice and nothing is re-tokenised. A span shared by several samples becomes one
node when it is at least ``min_shared`` tokens long (shorter spans are cheaper to repeat than to forward apart); the
samples below it continue in child nodes. A sample's tokens are the spans of the nodes on its root-to-node path.

Forward layout (``ForwardLayout``), built at collate time: each tree of the forest is packed into one row, its nodes
in creation order (a node's tokens after its ancestors'), under a mask that lets a token see its ancestors' tokens
and its own node's earlier ones; ``agentrl.training.logprobs.layout_logprobs`` forwards all rows in one model call,
so every shared span is computed once. A node's tokens, with ``[a, b)`` its span:

* a root holds tokens ``0 .. b-2`` at positions ``0 .. b-2`` and predicts tokens ``1 .. b-1``;
* any other node holds tokens ``a-1 .. b-2`` at positions ``a-1 .. b-2`` and predicts tokens ``a .. b-1``. Its first
  input repeats the parent's last token (the parent does not hold it): the logits there predict the node's first
  token, so each child scores its own first token, and the parent's last token is computed once per child, at its
  correct position.

Every position below ``b-1`` thus appears exactly once among a node's ancestors, at its own position, and each node
predicts exactly its tokens. When no span is shared every row is one sample and the mask is plain causal attention
(``mask`` is ``None``). ``out_index`` maps every ``(sample, position)`` of the micro-batch's dense
``[B, T]`` layout (``agentrl.training.batching``) to the predicted logprob of that token, so the loss sees the same
per-sample tensors as with one forward per sample; a token shared by several samples is scored once and weighted
once per sample by each sample's own loss mask and advantage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MIN_SHARED_TOKENS = 32
"""Shortest span that several samples share and that gets a node of its own: a shorter span is forwarded once per
sample, which costs less than another model call."""


@dataclass(frozen=True)
class Node:
    """Tokens ``[start, end)`` shared by every sample through this node; ``parent`` is -1 for a root."""

    start: int
    end: int
    parent: int
    depth: int
    sample: int  # one sample through the node (they all hold the same tokens here)

    @property
    def width(self) -> int:
        """Tokens of the node's row: it predicts ``[max(start, 1), end)``."""
        return self.end - max(self.start, 1)


@dataclass
class Forest:
    """Nodes in creation order (a parent before its children) and each sample's root-to-node path (node ids)."""

    nodes: list[Node]
    paths: list[list[int]]

    def shape(self) -> tuple[int, int]:
        """``(rows, longest row)`` of its packed layout (one row per tree): a pass forwards their product."""
        tree_of: list[int] = []
        widths: dict[int, int] = {}
        for node_id, node in enumerate(self.nodes):
            tree_of.append(node_id if node.parent < 0 else tree_of[node.parent])
            if node.width > 0:
                widths[tree_of[-1]] = widths.get(tree_of[-1], 0) + node.width
        return len(widths), max(widths.values(), default=0)


def shape_cost(shape: tuple[int, int], multiple: int = 1) -> int:
    """Padded tokens forwarded for a packed ``(rows, longest row)`` (the row rounded up to ``multiple``)."""
    rows, width = shape
    return rows * -(-width // multiple) * multiple


def merge_shapes(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """The shape of two forests forwarded together (rows add up, the longest row wins)."""
    return a[0] + b[0], max(a[1], b[1])


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (binary search over slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def lexicographic_order(seqs: Sequence[Sequence[int]]) -> list[int]:
    """Indices of ``seqs`` in lexicographic order of their tokens (ties by index)."""
    return sorted(range(len(seqs)), key=lambda i: (list(seqs[i]), i))


def build_forest(seqs: Sequence[Sequence[int]], min_shared: int = MIN_SHARED_TOKENS) -> Forest:
    """The prefix forest of ``seqs`` (see the module doc); ``min_shared`` must be at least 2."""
    if min_shared < 2:
        raise ValueError(f"min_shared must be at least 2, got {min_shared}")
    seqs = [list(s) for s in seqs]
    order = lexicographic_order(seqs)
    lcp = [common_prefix_length(seqs[order[k]], seqs[order[k + 1]]) for k in range(len(order) - 1)]
    forest = Forest(nodes=[], paths=[[] for _ in seqs])

    def add(start: int, end: int, parent: int, depth: int, members: Sequence[int]) -> int:
        forest.nodes.append(Node(start, end, parent, depth, members[0]))
        for i in members:
            forest.paths[i].append(len(forest.nodes) - 1)
        return len(forest.nodes) - 1

    stack = [(0, len(order), 0, -1, 0)] if order else []  # ranges [lo, hi) of `order` sharing tokens [0, start)
    while stack:
        lo, hi, start, parent, depth = stack.pop()
        if hi - lo == 1:
            if len(seqs[order[lo]]) > start:
                add(start, len(seqs[order[lo]]), parent, depth, order[lo:hi])
            continue  # else the sample ends where its parent ends
        common = min(lcp[lo:hi - 1])
        if common - start >= min_shared:
            parent = add(start, common, parent, depth, order[lo:hi])
            start, depth = common, depth + 1
        cuts = [k + 1 for k in range(lo, hi - 1) if lcp[k] == common]
        runs = list(zip([lo, *cuts], [*cuts, hi]))
        stack.extend((a, b, start, parent, depth) for a, b in reversed(runs))
    return forest


@dataclass
class ForwardLayout:
    """How to forward a micro-batch: one row per tree of its forest (see the module doc), all ``[R, W]``.

    ``input_ids`` go to the model, and ``positions`` with the mask (without one the model counts them itself);
    ``labels`` are the tokens each position predicts, ``scored`` where a sample through the node has a loss token
    there. ``mask`` (``[R, W, W]`` bool, True: may attend) is ``None`` when
    every row is one sample (causal attention, padding after the tokens). ``out_index`` (``[B, T]``) indexes the
    concatenation of a 0 and the flattened ``[R, W]`` predicted logprobs: entry ``(b, i)`` is the logprob of token
    ``i`` of row ``b``'s sample (0: position 0 and padding).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    scored: torch.Tensor
    mask: torch.Tensor | None
    out_index: torch.Tensor

    @property
    def computed_tokens(self) -> int:
        """Tokens the model forwards, padding included."""
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> ForwardLayout:
        return ForwardLayout(*(None if t is None else t.to(device) for t in (
            self.input_ids, self.positions, self.labels, self.scored, self.mask, self.out_index)))


def forward_layout(seqs: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]], forest: Forest, width: int,
                   *, pad_token_id: int = 0, pad_to_multiple_of: int = 1) -> ForwardLayout:
    """The packed layout of ``forest`` (built from ``seqs``) for a dense ``[len(seqs), width]`` micro-batch.

    ``loss_masks[i]`` marks the tokens of sample ``i`` that carry loss: only those positions get the LM head.
    """
    nodes = forest.nodes
    placed: dict[int, tuple[int, int]] = {}  # node -> (row, offset); a node without tokens has no place
    fill: list[int] = []  # tokens placed in each row so far
    for node_id, node in enumerate(nodes):
        if node.width <= 0:
            continue
        if node.parent in placed:
            row = placed[node.parent][0]
        else:
            row = len(fill)
            fill.append(0)
        placed[node_id] = (row, fill[row])
        fill[row] += node.width
    scored_by_node: dict[int, list[bool]] = {}
    for sample, path in enumerate(forest.paths):
        for node_id in path:
            if node_id in placed:
                node = nodes[node_id]
                mask = [bool(m) for m in loss_masks[sample][max(node.start, 1):node.end]]
                have = scored_by_node.setdefault(node_id, mask)
                if have is not mask:
                    scored_by_node[node_id] = [x or y for x, y in zip(have, mask)]
    rows, row_width = len(fill), -(-max(fill, default=0) // pad_to_multiple_of) * pad_to_multiple_of
    input_ids = torch.full((rows, row_width), pad_token_id, dtype=torch.long)
    labels = torch.full((rows, row_width), pad_token_id, dtype=torch.long)
    positions = torch.zeros((rows, row_width), dtype=torch.long)
    scored = torch.zeros((rows, row_width), dtype=torch.bool)
    shared = any(nodes[node_id].parent in placed for node_id in placed)
    allowed = torch.eye(row_width, dtype=torch.bool).repeat(rows, 1, 1) if shared else None  # padding sees itself
    for node_id, (row, offset) in placed.items():
        node = nodes[node_id]
        tokens, first, end = seqs[node.sample], max(node.start, 1), offset + node.width
        input_ids[row, offset:end] = torch.tensor(tokens[first - 1:node.end - 1], dtype=torch.long)
        labels[row, offset:end] = torch.tensor(tokens[first:node.end], dtype=torch.long)
        positions[row, offset:end] = torch.arange(first - 1, node.end - 1)
        scored[row, offset:end] = torch.tensor(scored_by_node.get(node_id, [False] * node.width), dtype=torch.bool)
        if allowed is not None:
            allowed[row, offset:end, offset:end] = torch.ones((node.width, node.width), dtype=torch.bool).tril()
            ancestor = node.parent
            while ancestor in placed:
                above = placed[ancestor][1]
                allowed[row, offset:end, above:above + nodes[ancestor].width] = True
                ancestor = nodes[ancestor].parent
    out_index = torch.zeros((len(seqs), width), dtype=torch.long)
    for sample, path in enumerate(forest.paths):
        for node_id in path:
            if node_id in placed:
                node, (row, offset) = nodes[node_id], placed[node_id]
                first, start = max(node.start, 1), 1 + row * row_width + offset
                out_index[sample, first:node.end] = torch.arange(start, start + node.end - first)
    return ForwardLayout(input_ids, positions, labels, scored, allowed, out_index)
