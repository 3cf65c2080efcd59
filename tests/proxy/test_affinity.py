"""Prompt-cache affinity: the replica each request goes to, by known prefix and by load."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.affinity import DEFAULT_SLACK, PROMPT_CHUNK, Affinity, conversation_key

SYSTEM = "You are a careful assistant. " * 200  # about 1,200 tokens: a long system prompt


def chat(system: str, turns: int, *, extra: str = "") -> dict[str, Any]:
    """The body of turn ``turns`` (1-based) of a conversation with its own system prompt."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": f"question {turn}{extra}"})
        if turn < turns:
            messages.append({"role": "assistant", "content": f"answer {turn}"})
    return {"model": "m", "messages": messages, "max_tokens": 16}


def test_turns_of_one_conversation_stick_to_its_replica() -> None:
    """Later turns go where the first went, even when that replica is somewhat busier."""
    affinity = Affinity(2)
    first = affinity.choose(chat("A " + SYSTEM, 1), [1, 0])
    assert first == 1
    for turn in (2, 3, 4):
        assert affinity.choose(chat("A " + SYSTEM, turn), [0, DEFAULT_SLACK]) == 1
    assert affinity.hits == [0, 3]
    assert affinity.misses == [0, 1]


def test_different_conversations_spread_by_load() -> None:
    """New conversations go to the least busy replica, and their later turns follow them."""
    affinity = Affinity(2)
    loads = [0, 0]
    homes = {}
    for n in range(8):
        replica = affinity.choose(chat(f"{n} {SYSTEM}", 1), loads)
        assert replica is not None
        homes[n] = replica
        loads[replica] += 1
    assert sorted(homes.values()).count(0) == 4
    for n in range(8):
        assert affinity.choose(chat(f"{n} {SYSTEM}", 2), loads) == homes[n]
    assert affinity.sent == [8, 8]


def test_equal_loads_alternate_by_requests_sent() -> None:
    """With equal loads and nothing known, ties go to the replica that was sent fewer requests."""
    affinity = Affinity(3)
    picks = [affinity.choose(chat(f"{n} {SYSTEM}", 1), [0, 0, 0]) for n in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]


def test_a_replica_more_than_slack_busier_loses_the_conversation() -> None:
    """Past the slack the least busy replica gets the turn, and the next turn follows it there."""
    affinity = Affinity(2, slack=2)
    assert affinity.choose(chat(SYSTEM, 1), [0, 1]) == 0
    assert affinity.choose(chat(SYSTEM, 2), [2, 0]) == 0  # exactly the slack: stays
    assert affinity.choose(chat(SYSTEM, 3), [3, 0]) == 1  # one more: spills
    assert affinity.spills == [1, 0]
    assert affinity.misses == [1, 1]
    # Replica 1 now knows the longer prefix: the conversation has moved.
    assert affinity.choose(chat(SYSTEM, 4), [0, 1]) == 1
    assert affinity.hits == [1, 1]


def test_slack_zero_sticks_only_while_not_busier() -> None:
    """With slack 0 a conversation stays while its replica is no busier than the least busy one."""
    affinity = Affinity(2, slack=0)
    assert affinity.choose(chat(SYSTEM, 1), [0, 0]) == 0
    assert affinity.choose(chat(SYSTEM, 2), [3, 3]) == 0
    assert affinity.choose(chat(SYSTEM, 3), [4, 3]) == 1


def test_a_replica_that_is_not_ready_is_never_chosen() -> None:
    """A replica whose load is None is skipped even when it knows the conversation; none ready gives None."""
    affinity = Affinity(2)
    assert affinity.choose(chat(SYSTEM, 1), [0, 5]) == 0
    assert affinity.choose(chat(SYSTEM, 2), [None, 9]) == 1
    assert affinity.choose(chat(SYSTEM, 3), [None, None]) is None
    assert affinity.choose({"model": "m"}, [None, None]) is None
    assert affinity.sent == [1, 1]


def test_memory_is_bounded_and_forgets_the_least_recently_sent() -> None:
    """Each replica remembers at most ``capacity`` conversations; the oldest is forgotten first."""
    affinity = Affinity(2, capacity=2)
    for name in ("A", "B", "C"):
        assert affinity.choose(chat(name + SYSTEM, 1), [0, 9]) == 0
    assert affinity.remembered(0) == 2
    # A was forgotten: its next turn goes by load; C is still known.
    assert affinity.choose(chat("A" + SYSTEM, 2), [3, 0]) == 1
    assert affinity.choose(chat("C" + SYSTEM, 2), [3, 0]) == 0


def test_a_longer_turn_replaces_the_sequence_it_extends() -> None:
    """Four turns of one conversation take one place in memory, as the engine keeps one cache for them."""
    affinity = Affinity(1, capacity=3)
    for turn in (1, 2, 3, 4):
        assert affinity.choose(chat(SYSTEM, turn), [0]) == 0
    assert affinity.remembered(0) == 1
    # Two other conversations still fit beside it.
    affinity.choose(chat("B" + SYSTEM, 1), [0])
    affinity.choose(chat("C" + SYSTEM, 1), [0])
    assert affinity.remembered(0) == 3
    assert affinity.choose(chat(SYSTEM, 5), [0]) == 0
    assert affinity.hits == [4]


def test_a_short_shared_system_prompt_does_not_pull_every_conversation() -> None:
    """A known prefix under half of the request's text does not count: the request goes by load."""
    affinity = Affinity(2)
    short = "Be brief."
    long_question = " and then?" * 100
    assert affinity.choose(chat(short, 1, extra=long_question), [0, 0]) == 0
    # Another conversation with the same short system prompt: only "Be brief." is known on 0.
    assert affinity.choose(chat(short, 1, extra="x" + long_question), [0, 0]) == 1
    assert affinity.hits == [0, 0]


def test_a_long_shared_system_prompt_is_a_hit_and_ties_go_by_load() -> None:
    """A long shared prefix pulls a new conversation to the replica knowing it; when both do, load decides."""
    affinity = Affinity(2)
    assert affinity.choose(chat(SYSTEM, 1, extra=" first"), [0, 0]) == 0
    assert affinity.choose(chat(SYSTEM, 1, extra=" second"), [1, 0]) == 0
    assert affinity.hits == [1, 0]
    affinity.record(1, chat(SYSTEM, 1, extra=" third"))
    assert affinity.choose(chat(SYSTEM, 1, extra=" fourth"), [2, 1]) == 1


def test_record_moves_a_conversation_to_the_replica_it_was_sent_to() -> None:
    """A request sent elsewhere than chosen (a retry) is remembered there by ``record``."""
    affinity = Affinity(2)
    assert affinity.choose(chat(SYSTEM, 1), [0, 0]) == 0
    affinity.record(1, chat(SYSTEM, 2))
    assert affinity.choose(chat(SYSTEM, 3), [0, 0]) == 1
    affinity.record(0, {"messages": "not a list"})  # nothing to remember, and no error
    assert affinity.remembered(0) == 1


def test_forget_empties_a_restarted_replica() -> None:
    """After ``forget`` (its engine restarted) a replica's conversations go by load again."""
    affinity = Affinity(2)
    assert affinity.choose(chat(SYSTEM, 1), [0, 1]) == 0
    affinity.forget(0)
    assert affinity.remembered(0) == 0
    assert affinity.choose(chat(SYSTEM, 2), [1, 0]) == 1
    assert affinity.hits == [0, 0]


@pytest.mark.parametrize(
    "doc",
    [
        None,
        "a string",
        [1, 2],
        {},
        {"model": "m"},
        {"messages": "hello"},
        {"messages": []},
        {"messages": [1, 2]},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": 7, "content": "x"}]},
        {"messages": [{"role": "user", "content": 7}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": {"nested": 1}}]}]},
        {"messages": [{"role": "user", "content": ["bare string part"]}]},
        {"messages": None, "prompt": None},
        {"prompt": ""},
        {"prompt": 42},
        {"prompt": [{"a": 1}]},
        {"prompt": ["two", "prompts"]},
        {"prompt": [[1, 2], [3]]},
    ],
)
def test_unreadable_shapes_fall_back_to_least_busy(doc: Any) -> None:
    """A conversation that cannot be read goes to the least busy replica as a miss, raising nothing."""
    affinity = Affinity(2)
    assert affinity.choose(doc, [3, 1]) == 1
    assert affinity.misses == [0, 1]
    assert affinity.remembered(1) == 0


def test_text_parts_are_keyed_like_plain_content() -> None:
    """Content given as a list of text parts keys the conversation, so its turns stick."""
    affinity = Affinity(2)
    parts = [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "and more"}]
    first = {"messages": [{"role": "system", "content": parts}, {"role": "user", "content": "hi"}]}
    second = {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ]
    }
    assert affinity.choose(first, [0, 1]) == 0
    assert affinity.choose(second, [1, 0]) == 0


def test_an_unreadable_message_ends_the_key_but_keeps_the_prefix_before_it() -> None:
    """An image part in a later message stops the key there; the readable turns before it still stick."""
    affinity = Affinity(2)
    assert affinity.choose(chat(SYSTEM, 2), [0, 1]) == 0
    later = chat(SYSTEM, 3)
    later["messages"][-1]["content"] = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    key = conversation_key(later)
    assert key is not None and len(key[0]) == len(later["messages"]) - 1
    assert affinity.choose(later, [1, 0]) == 0


def test_an_assistant_turn_without_content_is_part_of_the_key() -> None:
    """An assistant message with ``content: null`` (tool calls) does not end the key."""
    doc = chat(SYSTEM, 1)
    doc["messages"] += [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    key = conversation_key(doc)
    assert key is not None and len(key[0]) == 4


def test_an_extended_legacy_prompt_sticks() -> None:
    """A completions prompt that grows from an earlier one goes where the earlier one went."""
    affinity = Affinity(2)
    prompt = "Once upon a time " * 100
    assert affinity.choose({"prompt": prompt}, [0, 1]) == 0
    assert affinity.choose({"prompt": [prompt + " there was a fox."]}, [1, 0]) == 0
    assert affinity.choose({"prompt": "Something else " * 100}, [1, 0]) == 1


def test_a_token_id_prompt_is_keyed_by_chunks() -> None:
    """A prompt of token ids is keyed by chunks of ``PROMPT_CHUNK`` ids."""
    tokens = list(range(PROMPT_CHUNK * 2 + 3))
    key = conversation_key({"prompt": tokens})
    assert key is not None
    assert key[1] == (PROMPT_CHUNK, PROMPT_CHUNK * 2, PROMPT_CHUNK * 2 + 3)
    longer = conversation_key({"prompt": [*tokens[: PROMPT_CHUNK * 2], 7, 7, 7, 7]})
    assert longer is not None and longer[0][:2] == key[0][:2] and longer[0][2] != key[0][2]


def test_keys_are_prefixes_of_one_another_across_turns() -> None:
    """Turn n's key begins with turn n-1's: one hash per message boundary, chained."""
    two, three = conversation_key(chat(SYSTEM, 2)), conversation_key(chat(SYSTEM, 3))
    assert two is not None and three is not None
    assert three[0][: len(two[0])] == two[0]
    assert len(three[0]) == len(two[0]) + 2
    assert three[1][-1] > two[1][-1]
    other = conversation_key(chat("B" + SYSTEM, 2))
    assert other is not None and not set(other[0]) & set(two[0])


def test_a_single_replica_always_gets_the_request() -> None:
    """With one replica the choice is that replica while it is ready."""
    affinity = Affinity(1)
    assert affinity.choose(chat(SYSTEM, 1), [30]) == 0
    assert affinity.choose(None, [30]) == 0
    assert affinity.choose(chat(SYSTEM, 2), [None]) is None


def test_every_request_counts_one_hit_or_one_miss() -> None:
    """Hits and misses add up to the requests sent, per replica, and repr shows them."""
    affinity = Affinity(2, slack=1)
    loads = [0, 0]
    for n in range(4):
        for turn in (1, 2, 3):
            replica = affinity.choose(chat(f"{n}{SYSTEM}", turn), loads)
            assert replica is not None
            loads[replica] += 1 if turn < 3 else -1
    for replica in (0, 1):
        assert affinity.hits[replica] + affinity.misses[replica] == affinity.sent[replica]
    assert sum(affinity.sent) == 12
    assert "hits" in repr(affinity) and "slack=1" in repr(affinity)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replicas": 0}, "replicas"),
        ({"replicas": 2, "slack": -1}, "slack"),
        ({"replicas": 2, "capacity": 0}, "capacity"),
        ({"replicas": 2, "min_share": 1.5}, "min_share"),
    ],
)
def test_settings_out_of_range_are_refused(kwargs: dict[str, Any], message: str) -> None:
    """A replica count, slack, capacity or share out of range is a ValueError naming it."""
    with pytest.raises(ValueError, match=message):
        Affinity(**kwargs)
