"""The prefix cache: a radix tree over token ids, in the manner of SGLang's RadixCache.

Every finished prefill chunk is inserted (its KV moves from the request into the tree); a new
request's longest cached prefix is reused instead of recomputed. Nodes that a running request
depends on are locked; unlocked tokens are *evictable*, least recently used leaves first, and count
as free space for admission. :class:`NoPrefixCache` is ``--disable-radix-cache``.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class Node:
    __slots__ = ("children", "key", "last_used", "lock", "parent", "serial")

    def __init__(self, key: tuple[int, ...], parent: Node | None, serial: int = 0) -> None:
        self.serial = serial  # creation order: breaks LRU ties deterministically
        self.key = key
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.lock = 0
        self.last_used = 0


def _common_len(key: tuple[int, ...], ids: Sequence[int], start: int) -> int:
    n = min(len(key), len(ids) - start)
    if key[:n] == tuple(ids[start : start + n]):
        return n
    i = 0
    while i < n and key[i] == ids[start + i]:
        i += 1
    return i


class RadixCache:
    enabled = True

    def __init__(self) -> None:
        self.root = Node((), None)
        self.root.lock = 1  # never evicted
        self.total_size = 0
        self.evictable_size = 0
        self._tick = 0
        self._serial = 0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def _next_serial(self) -> int:
        self._serial += 1
        return self._serial

    def _touch(self, node: Node) -> None:
        self._tick += 1
        while node is not None:
            node.last_used = self._tick
            node = node.parent  # type: ignore[assignment]

    def _split(self, child: Node, at: int) -> Node:
        """Cut ``child``'s edge after ``at`` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = Node(child.key[:at], parent, self._next_serial())
        upper.lock = child.lock
        upper.last_used = child.last_used
        parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def peek(self, ids: Sequence[int]) -> int:
        """Length of the cached prefix of ``ids``, without touching the tree."""
        node, i = self.root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            m = _common_len(child.key, ids, i)
            i += m
            if m < len(child.key):
                break
            node = child
        return i

    def match(self, ids: Sequence[int]) -> tuple[int, Node]:
        """(cached prefix length, the node that ends it); splits an edge so the node ends exactly there."""
        node, i = self.root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            m = _common_len(child.key, ids, i)
            if m < len(child.key):
                if m > 0:
                    node = self._split(child, m)
                    i += m
                break
            node, i = child, i + m
        self._touch(node)
        return i, node

    def insert(self, ids: Sequence[int]) -> tuple[int, Node]:
        """Insert ``ids``; returns (tokens newly owned by the tree, the node that ends ``ids``)."""
        node, i = self.root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                leaf = Node(tuple(ids[i:]), node, self._next_serial())
                node.children[leaf.key[0]] = leaf
                added = len(leaf.key)
                self.total_size += added
                self.evictable_size += added
                self._touch(leaf)
                return added, leaf
            m = _common_len(child.key, ids, i)
            if m < len(child.key):
                child = self._split(child, m)
            node, i = child, i + m
        self._touch(node)
        return 0, node

    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock == 0:
                self.evictable_size -= len(node.key)
            node.lock += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock -= 1
            if node.lock == 0:
                self.evictable_size += len(node.key)
            node = node.parent  # type: ignore[assignment]

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` unlocked tokens (least recently used leaves first) if it can."""
        leaves: list[tuple[int, int, Node]] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n.lock == 0:
                leaves.append((n.last_used, n.serial, n))
        heapq.heapify(leaves)
        freed = 0
        while freed < num_tokens and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(leaves, (parent.last_used, parent.serial, parent))
        self.total_size -= freed
        self.evictable_size -= freed
        return freed


class NoPrefixCache:
    """``--disable-radix-cache``: nothing is shared, every request owns all of its KV."""

    enabled = False
    total_size = 0
    evictable_size = 0

    def reset(self) -> None:
        pass

    def peek(self, ids: Sequence[int]) -> int:
        return 0

    def match(self, ids: Sequence[int]) -> tuple[int, None]:
        return 0, None

    def insert(self, ids: Sequence[int]) -> tuple[int, None]:
        return 0, None

    def lock(self, node: object) -> None:
        pass

    def unlock(self, node: object) -> None:
        pass

    def evict(self, num_tokens: int) -> int:
        return 0
