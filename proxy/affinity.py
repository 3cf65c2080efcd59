"""Prompt-cache affinity: send a conversation where its earlier turns went (pure).

An engine keeps the prompts it has computed: mlx_lm.server an LRU of prompt
caches (``--prompt-cache-size``, 10 by default) reused by the longest matching
prefix, vLLM and SGLang a prefix cache. A chat's next turn repeats its earlier
turns word for word, so the replica that served them computes only the new
part. SGLang's router (its cache_aware policy) keeps an approximate radix tree
of request text per worker, routes to the longest match while the load is
balanced, and to the least loaded worker otherwise. This keeps the same
decision with less: one hash per message boundary of the conversation.

- The key (``conversation_key``) is read from the body the relay parsed
  already: a chained hash per message (``hash((previous, role, content))``),
  so that prefix *i* of the conversation is one integer, and the characters up
  to it. A legacy ``prompt`` is cut into fixed chunks instead. It costs a
  hash over the text (a few µs for a 1,500-token system prompt) and never
  raises: a shape it cannot read (content parts other than text, a message
  that is not an object) ends the key there, and a request with no key at all
  goes to the least busy replica.
- Each replica remembers, like the engine, up to ``capacity`` sequences (LRU),
  each with all its prefixes; a sequence that extends a remembered one takes
  its place, as mlx_lm.server drops the caches that a longer one contains.
  A count per prefix makes "how much of this conversation does replica r
  know" a walk over the key that stops at the first unknown prefix.
- ``choose`` sends a request to the replica that knows the longest prefix of
  it (at least ``min_share`` of its text; ties to the least busy), unless that
  replica has more than ``slack`` requests in flight beyond the least busy
  one: then to the least busy (a spill). What it chose is remembered there.

What the key leaves out: ``tools``, ``chat_template_kwargs`` and other fields
that change the rendered prompt. They stay the same over one conversation, so
its turns still meet; two conversations that differ only in them look alike,
which costs a cache miss, not a wrong answer. Python's ``hash`` is salted per
process, which is fine: the memory lives in one process and is never shared.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

# A replica busier than the least busy by more than this loses the request.
# Half of mlx_lm.server's prefill batch (--prompt-concurrency 8): a replica
# that much busier still takes the request into its next prefill, and a cached
# prefix saves the whole of a long prompt's prefill. Past it the queue in
# front of the preferred replica grows faster than the cache saves.
DEFAULT_SLACK = 4
# Sequences remembered per replica: mlx_lm.server's --prompt-cache-size default.
DEFAULT_CAPACITY = 10
# A known prefix must cover this share of the request's text to count (SGLang's
# cache_threshold): a short system prompt shared by every conversation should
# not pull them all to one replica.
DEFAULT_MIN_SHARE = 0.5
# Prefixes keyed per request: bounds the hashing and the memory per sequence.
MAX_PREFIXES = 256
# A legacy prompt is keyed by chunks of this many characters (or token ids).
PROMPT_CHUNK = 512

_CHAT_SEED = 0x5EED_C4A7
_PROMPT_SEED = 0x5EED_7E47

# (prefix hashes, text length up to each prefix); one entry per prefix.
Key = tuple[tuple[int, ...], tuple[int, ...]]


def _text(content: Any) -> str | None:
    """A message's content as one string, or None when it is not only text."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""  # an assistant turn that only calls tools
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            texts.append(text)
        return "\n".join(texts)
    return None


def _chat_key(messages: Any) -> Key | None:
    if not isinstance(messages, list):
        return None
    chained = _CHAT_SEED
    total = 0
    hashes: list[int] = []
    ends: list[int] = []
    for message in messages[:MAX_PREFIXES]:
        if not isinstance(message, dict):
            break
        role = message.get("role")
        text = message.get("content")
        if not isinstance(text, str):  # the common case needs no call
            text = _text(text)
            if text is None:
                break
        if not isinstance(role, str):
            break
        chained = hash((chained, role, text))
        total += len(role) + len(text)
        hashes.append(chained)
        ends.append(total)
    return (tuple(hashes), tuple(ends)) if hashes else None


def _prompt_key(prompt: Any) -> Key | None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one
    if not prompt or not (isinstance(prompt, str) or (isinstance(prompt, list) and type(prompt[0]) is int)):
        return None  # nothing, or a batch of prompts: not one conversation
    chained = _PROMPT_SEED
    hashes: list[int] = []
    ends: list[int] = []
    limit = min(len(prompt), PROMPT_CHUNK * MAX_PREFIXES)
    try:
        for start in range(0, limit, PROMPT_CHUNK):
            chunk = prompt[start : start + PROMPT_CHUNK]
            chained = hash((chained, chunk if isinstance(chunk, str) else tuple(chunk)))
            hashes.append(chained)
            ends.append(start + len(chunk))
    except TypeError:  # a list that is not all token ids
        return None
    return tuple(hashes), tuple(ends)


def conversation_key(doc: Any) -> Key | None:
    """The prefix hashes of a parsed request's conversation, or None when it has none."""
    if not isinstance(doc, dict):
        return None
    messages = doc.get("messages")
    if messages is not None:
        return _chat_key(messages)
    return _prompt_key(doc.get("prompt"))


class _Memory:
    """What one replica was sent: an LRU of sequences and a count per prefix."""

    __slots__ = ("counts", "sequences")

    def __init__(self) -> None:
        # The last prefix hash of a sequence → all its prefix hashes, oldest first.
        self.sequences: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        # Prefix hash → how many remembered sequences hold it.
        self.counts: dict[int, int] = {}

    def depth(self, hashes: tuple[int, ...]) -> int:
        """How many leading prefixes of ``hashes`` are known (every sequence counts all its prefixes)."""
        counts = self.counts
        known = 0
        for value in hashes:
            if value not in counts:
                break
            known += 1
        return known

    def remember(self, hashes: tuple[int, ...], capacity: int) -> None:
        sequences = self.sequences
        last = hashes[-1]
        if last in sequences:
            sequences.move_to_end(last)
            return
        counts = self.counts
        # A remembered sequence that this one extends is replaced by it (the
        # engine drops the caches a longer one contains). The longest hands its
        # counts over; shorter ones (rare) are dropped.
        counted = 0
        for index in range(len(hashes) - 2, -1, -1):
            value = hashes[index]
            if value in sequences:
                if counted:
                    self._drop(value)
                else:
                    del sequences[value]
                    counted = index + 1
        for value in hashes[counted:]:
            counts[value] = counts.get(value, 0) + 1
        sequences[last] = hashes
        while len(sequences) > capacity:
            self._drop(next(iter(sequences)))

    def _drop(self, last: int) -> None:
        counts = self.counts
        for value in self.sequences.pop(last):
            left = counts[value] - 1
            if left:
                counts[value] = left
            else:
                del counts[value]

    def clear(self) -> None:
        self.sequences.clear()
        self.counts.clear()


class Affinity:
    """Which of a model's replicas gets each request, by prompt cache then by load.

    ``choose(doc, loads)`` takes the parsed body and each replica's requests in
    flight (None: not ready), returns the replica's index (None when none is
    ready) and remembers the request there. Per replica: ``hits`` (sent where
    a prefix of it was known), ``misses`` (sent by load: nothing known, too
    little, or a spill) and ``spills`` (the replica knew it but was more than
    ``slack`` busier, so another got it). Every request counts one hit or one
    miss, on the replica it went to.
    """

    __slots__ = ("_memories", "capacity", "hits", "min_share", "misses", "sent", "slack", "spills")

    def __init__(
        self,
        replicas: int,
        slack: int = DEFAULT_SLACK,
        capacity: int = DEFAULT_CAPACITY,
        min_share: float = DEFAULT_MIN_SHARE,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, not {replicas}")
        if slack < 0:
            raise ValueError(f"slack must be at least 0, not {slack}")
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        if not 0 <= min_share <= 1:
            raise ValueError(f"min_share must be from 0 to 1, not {min_share}")
        self.slack = slack
        self.capacity = capacity
        self.min_share = min_share
        self._memories = tuple(_Memory() for _ in range(replicas))
        self.hits = [0] * replicas
        self.misses = [0] * replicas
        self.spills = [0] * replicas
        self.sent = [0] * replicas

    def choose(self, doc: Any, loads: Sequence[int | None]) -> int | None:
        """The replica for this request (remembered there), or None when no replica is ready."""
        sent = self.sent
        least, least_load = -1, 0
        for index, load in enumerate(loads):
            if load is not None and (
                least < 0 or load < least_load or (load == least_load and sent[index] < sent[least])
            ):
                least, least_load = index, load
        if least < 0:
            return None
        key = conversation_key(doc)
        if key is None:
            self.misses[least] += 1
            sent[least] += 1
            return least
        hashes, ends = key
        best, best_depth, best_load = -1, 0, 0
        for index, load in enumerate(loads):
            if load is None:
                continue
            depth = self._memories[index].depth(hashes)
            if depth > best_depth or (
                depth == best_depth
                and depth
                and (load < best_load or (load == best_load and sent[index] < sent[best]))
            ):
                best, best_depth, best_load = index, depth, load
        chosen = least
        if best < 0 or ends[best_depth - 1] < self.min_share * ends[-1]:
            self.misses[least] += 1
        elif best_load - least_load > self.slack:
            self.spills[best] += 1
            self.misses[least] += 1
        else:
            chosen = best
            self.hits[best] += 1
        sent[chosen] += 1
        self._memories[chosen].remember(hashes, self.capacity)
        return chosen

    def record(self, replica: int, doc: Any) -> None:
        """Remember a request sent to ``replica`` without ``choose`` (one moved to another replica)."""
        key = conversation_key(doc)
        if key is not None:
            self._memories[replica].remember(key[0], self.capacity)

    def forget(self, replica: int) -> None:
        """Forget what ``replica`` was sent: its engine restarted with an empty cache."""
        self._memories[replica].clear()

    def remembered(self, replica: int) -> int:
        """How many sequences ``replica`` is remembered to hold (at most ``capacity``)."""
        return len(self._memories[replica].sequences)

    def __repr__(self) -> str:
        per = ", ".join(
            f"{i}: {self.hits[i]} hits {self.misses[i]} misses {self.spills[i]} spills "
            f"{self.remembered(i)}/{self.capacity} remembered"
            for i in range(len(self._memories))
        )
        return f"<Affinity slack={self.slack} [{per}]>"
