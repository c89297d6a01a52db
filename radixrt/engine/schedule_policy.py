"""Order in which waiting requests are offered admission."""

from __future__ import annotations

import time
from collections import defaultdict

from radixrt.engine.request import Req
from radixrt.mem_cache.radix_cache import RadixCache, TreeNode

LPM_FALLBACK_QUEUE_LEN = 128  # past this, matching every waiting request costs more than it saves
AGING_TOKENS_PER_SECOND = 256  # a request waiting 1 s ranks as if 256 more tokens were cached


def match_key(req: Req) -> list[int]:
    """The prefix a request may take from the cache: at least one token must still be computed,
    and prompt logprobs need hidden states from `logprob_start_len` on."""
    end = len(req.all_ids) - 1
    if req.wants_prompt_logprobs():
        end = min(end, req.params.logprob_start_len)
    return req.all_ids[:end]


def order_waiting(policy: str, waiting: list[Req], tree: RadixCache) -> list[Req]:
    if policy == "fcfs" or len(waiting) > LPM_FALLBACK_QUEUE_LEN or tree.disable:
        return list(waiting)
    matches = {id(r): tree.match_prefix(match_key(r)) for r in waiting}
    if policy == "lpm":
        now = time.monotonic()
        return sorted(
            waiting,
            key=lambda r: -(matches[id(r)].length + AGING_TOKENS_PER_SECOND * (now - r.arrival)),
        )
    if policy == "dfs-weight":
        return _dfs_weight(waiting, {id(r): matches[id(r)].end_node for r in waiting}, tree.root)
    raise ValueError(f"unknown schedule policy {policy!r}")


def _dfs_weight(waiting: list[Req], last_nodes: dict[int, TreeNode], root: TreeNode) -> list[Req]:
    """Walk the tree depth first, heaviest subtree (most waiting requests) first, so requests
    that share a prefix run back to back while it is cached."""
    at_node: dict[TreeNode, list[Req]] = defaultdict(list)
    weight: dict[TreeNode, int] = defaultdict(int)
    children: dict[TreeNode, set[TreeNode]] = defaultdict(set)
    for req in waiting:
        node = last_nodes[id(req)]
        at_node[node].append(req)
        while node is not root:
            weight[node] += 1
            children[node.parent].add(node)
            node = node.parent
    order: list[Req] = []
    stack = [root]
    while stack:
        node = stack.pop()
        order.extend(at_node[node])
        stack.extend(sorted(children[node], key=lambda n: weight[n]))  # heaviest popped first
    return order


def pick_victim(candidates: list[Req]) -> Req | None:
    """The running request whose retraction loses least: fewest generated tokens, then the
    longest prompt (most of it comes back from the cache). None when there is no other choice."""
    if len(candidates) <= 1:
        return None
    return min(candidates, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
