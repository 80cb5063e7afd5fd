"""Draft trees: a round verifies the drafter's next-best ids beside its drafts (docs/design.md, Draft trees).

One drafter pass gives, for each slot i of a block, its argmax d_i with probability c_i and next-best ids g
with probabilities q_i(g). A chain verifies t, d_1 .. d_(W-1). A tree also verifies next-best ids, each
after the path of ids that leads to it: a node is one id per slot from slot 1 to its depth. The slots of a
block are predicted in one pass, each from the clean prefix alone, so they are read as independent: a
node's value, the drafter's probability that the target's greedy tokens follow the node's whole path, is
the product of its path's probabilities. Nodes are taken best first (a child's value never exceeds its
parent's, so parents come first) and the tree keeps the count N that maximises the expected committed
tokens, 1 + the sum of the kept values, over the round's cost, `WidthPolicy.round_cost(N + 1)`: the same
rule `WidthPolicy.choose` applies to a chain, which is the tree without next-best ids.

The target verifies every node in one pass, each node seeing the committed prefix and its own ancestors
(models.masks.tree_mask). The greedy outcome walks from t to the child whose id is the target's choice
after the current node, as long as there is one, and commits that path and the target's choice after its
last node: the target's own greedy tokens, as with a chain. Sampling verifies chains only.

Nodes are stored in the order they are fed: t first, then the main chain (the argmax path d_1, d_2, ..),
then the other nodes, each after its parent. The async decoder plans its packed pass on the main chain.
"""

import heapq
from dataclasses import dataclass

from .cost import WidthPolicy


@dataclass
class DraftTree:
    """The tokens one round verifies, as a tree rooted at t.

    Attributes:
        tokens: fed ids, t first (`(N + 1,)` as a list); tokens[1 : chain] are the main chain's drafts.
        parents: per fed token, the index of its parent among them (-1 for t); parents[i] < i.
        chain: fed tokens on the main chain, t included.
    """

    tokens: list[int]
    parents: list[int]
    chain: int

    @property
    def is_chain(self) -> bool:
        return len(self.tokens) == self.chain


def grow(root: int, drafts: list[int], confidences: list[float], alternatives: list[list[tuple[int, float]]],
         branches: int, max_nodes: int, policy: WidthPolicy | None) -> DraftTree:
    """The tree of one round (see the module docstring).

    Args:
        root: t, the last committed token.
        drafts, confidences, alternatives: per slot, the drafter's argmax, its probability, and the
            next-best (id, probability) pairs, best first; as many slots as the round may reach.
        branches: next-best ids per slot the tree may take (0: a chain).
        max_nodes: most nodes after t (the verify block less one).
        policy: the cost model that chooses the node count; None keeps `max_nodes` nodes.
    """
    depth_limit = min(len(drafts), max_nodes)
    options = [[(drafts[d], confidences[d])] + list(alternatives[d][:branches]) for d in range(depth_limit)]
    # best first by value; ties by depth, then by rank along the path (the main chain first)
    heap = [(-prob, (rank,)) for rank, (_, prob) in enumerate(options[0])] if depth_limit else []
    heapq.heapify(heap)
    taken: list[tuple[float, tuple[int, ...]]] = []
    while heap and len(taken) < max_nodes:
        value, path = heapq.heappop(heap)
        taken.append((-value, path))
        if len(path) < depth_limit:
            for rank, (_, prob) in enumerate(options[len(path)]):
                heapq.heappush(heap, (value * prob, path + (rank,)))
    count = policy.best_count([value for value, _ in taken]) if policy is not None and taken else len(taken)
    kept = [path for _, path in taken[:count]]
    # Fed order: the main chain (all ranks 0) by depth, then the others in the order taken (parents first).
    main = sorted((path for path in kept if not any(path)), key=len)
    ordered = main + [path for path in kept if any(path)]
    index = {(): 0}
    tokens, parents = [root], [-1]
    for path in ordered:
        index[path] = len(tokens)
        tokens.append(options[len(path) - 1][path[-1]][0])
        parents.append(index[path[:-1]])
    return DraftTree(tokens, parents, 1 + len(main))


def depths(parents: list[int]) -> list[int]:
    """Per fed token of a tree with `parents` (as `DraftTree.parents`), its distance from t: the offset of its
    position after t's."""
    result: list[int] = []
    for parent in parents:
        result.append(0 if parent < 0 else result[parent] + 1)
    return result


def greedy_path(tokens: list[int], parents: list[int], answers: list[int]) -> tuple[list[int], int]:
    """(the fed indices of the accepted nodes after t, in order; the target's choice after the last of them)
    for a tree of fed `tokens` with `parents` (as `DraftTree`'s).

    `answers[i]` is the target's greedy choice after fed token i (read only along the accepted path)."""
    children: dict[int, dict[int, int]] = {}  # siblings carry distinct ids
    for i in range(1, len(tokens)):
        children.setdefault(parents[i], {})[tokens[i]] = i
    path, node = [], 0
    while (child := children.get(node, {}).get(answers[node])) is not None:
        path.append(child)
        node = child
    return path, answers[node]
