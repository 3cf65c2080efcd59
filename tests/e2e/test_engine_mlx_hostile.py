"""Request bodies that take the real mlx_lm.server 0.32.0 offline stop at the gateway.

Each body below was sent to the real engine (`--engine mlx-0.32.0 --model
builtin:tiny`, a 259-token vocabulary) and killed its generation thread
(the log says "mlx_lm.server generation thread died", /health turns 503 and
every later request fails until a restart), crashed the process (SIGSEGV),
hung it (every other request waits), made it hold hundreds of MiB per
request, or made it generate for nobody after the client had gone.
mlx_lm.server validates these fields only partly in its HTTP handler; the
rest is checked, if at all, inside the one generation thread, outside any
per-request try. ATTACK-FINDINGS.md names the mlx_lm line behind each.

The gateway must answer each with a 4xx in OpenAI's error envelope, and the
child must serve the next request as before: same pid, no "generation
thread died" in its log. One gateway serves the module; a case that leaves
its child dead, hung or replaced gets a fresh gateway for the next case.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_engine_mlx import ENGINE, start_engine_gateway
from tests.e2e.test_engine_mlx import engine_installed as engine_installed
from tests.helpers import ENGINE_READY, EngineGateway, engine_home, pid_alive

pytestmark = [
    pytest.mark.fault("engines", "requests that would break the engine"),
    # A hung engine costs two answer deadlines and a fresh gateway (its start included).
    pytest.mark.timeout(300),
]

# The name this module serves builtin:tiny under, so that the child's log is its own
# (other tests serve the same model under its default name, in the same engine home).
NAME = "hostile-tiny"
CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
# The tiny model's vocabulary: config.json's vocab_size, the width of its logits.
VOCAB = 259
# A hostile request gets this long to be answered; the request after it as long again.
_ANSWER_S = 45.0
_THREAD_DIED = "generation thread died"


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def text(**fields: Any) -> dict[str, Any]:
    return {"model": NAME, "max_tokens": 4, **fields}


def _nested_loops() -> str:
    """A chat template that renders for hours: sandboxed Jinja caps one range, not two nested."""
    return "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


# id -> (path, body). What each did to the engine when sent straight to it is in the id.
KILLERS: dict[str, tuple[str, dict[str, Any]]] = {
    # sample_utils.apply_top_k raises in the batch step: top_k must be below the vocabulary.
    "top_k_equal_to_vocab_kills_thread": (CHAT, chat(top_k=VOCAB, temperature=1.0)),
    "top_k_past_int64_kills_thread": (CHAT, chat(top_k=10**30, temperature=1.0)),
    # categorical_sampling and the penalties' logits updates cast to int64: std::bad_cast from 2**63.
    # A literal past 64 bits is a float to orjson and an int to the engine's json.loads.
    "temperature_past_int64_kills_thread": (CHAT, chat(temperature=2**63)),
    "presence_penalty_literal_past_64_bits_kills_thread": (CHAT, chat(presence_penalty=-(10**30))),
    # sample_utils.apply_xtc raises for a threshold past 0.5; the server allows up to 1.
    "xtc_threshold_above_half_kills_thread": (
        CHAT,
        chat(xtc_probability=0.5, xtc_threshold=0.9, temperature=1.0),
    ),
    "xtc_threshold_just_above_half_kills_thread": (
        CHAT,
        chat(xtc_probability=1e-300, xtc_threshold=0.5000001, temperature=1.0),
    ),
    # make_logits_processors indexes the logits with the keys unchecked.
    "logit_bias_int32_max_segfaults": (CHAT, chat(logit_bias={str(2**31 - 1): 5})),
    "logit_bias_far_negative_segfaults": (CHAT, chat(logit_bias={"-300": 5})),
    "logit_bias_past_int64_kills_thread": (CHAT, chat(logit_bias={str(2**63): 5})),
    "logit_bias_just_past_vocab_writes_out_of_bounds": (CHAT, chat(logit_bias={str(VOCAB): 5})),
    # The penalty processors slice the token history with -context_size (32-bit slices only).
    "repetition_context_past_int32_kills_thread": (
        CHAT,
        chat(repetition_penalty=1.1, repetition_context_size=2**31 + 1),
    ),
    "presence_context_int64_max_kills_thread": (
        CHAT,
        chat(presence_penalty=0.5, presence_context_size=2**63 - 1),
    ),
    "frequency_context_past_int32_kills_thread": (
        CHAT,
        chat(frequency_penalty=0.5, frequency_context_size=2**31 + 1),
    ),
    # BatchGenerator.insert_segments raises on an empty prompt.
    "empty_completion_prompt_kills_thread": (TEXT, text(prompt="")),
    # A list of strings encodes to a list of lists: unhashable in the prompt cache's trie.
    "completion_prompt_list_of_strings_kills_thread": (TEXT, text(prompt=["ab", "cd"])),
    "completion_prompt_one_string_in_a_list_kills_thread": (TEXT, text(prompt=["ab"])),
    # chat_template_kwargs go to tokenizer.apply_chat_template as its own arguments.
    "chat_template_kwargs_return_tensors_kills_thread": (
        CHAT,
        chat(chat_template_kwargs={"return_tensors": "np"}),
    ),
    "chat_template_kwargs_truncation_to_nothing_kills_thread": (
        CHAT,
        chat(chat_template_kwargs={"truncation": True, "max_length": 0}),
    ),
    "chat_template_kwargs_empty_template_kills_thread": (
        CHAT,
        chat(chat_template_kwargs={"chat_template": "{% if false %}x{% endif %}"}),
    ),
    "chat_template_kwargs_looping_template_hangs_engine": (
        CHAT,
        chat(chat_template_kwargs={"chat_template": _nested_loops()}),
    ),
    "chat_template_kwargs_padding_hangs_engine": (
        CHAT,
        chat(chat_template_kwargs={"padding": "max_length", "max_length": 200_000}),
    ),
    # mlx never compares a prompt with the model's context (32768 here): 200,000 tokens of
    # prefill from a 200 KB body hold the engine, as the padding above does. Only the child
    # can count tokens: engines/mlx_lm_server.py answers 400 before any prefill.
    "prompt_past_the_context_length_holds_the_engine": (
        CHAT,
        {"model": NAME, "messages": [{"role": "user", "content": "ab" * 100_000}], "max_tokens": 4},
    ),
    # mlx writes a non-stream reply only at its end, and its streams carry no logprobs, so
    # the gateway cannot send this one as a stream: it generates for nobody once the client
    # has gone, for as long as max_tokens allows (32 of them fill the decode batch).
    "logprobs_with_endless_max_tokens_generates_after_the_client_leaves": (
        CHAT,
        chat(max_tokens=10**9, logprobs=True),
    ),
    # Each distinct stop list builds two automata in the generation thread (seconds),
    # and up to 101 of them are kept: ~320 MiB per 1 MB list, seen here.
    "twenty_thousand_stop_strings_hold_memory_and_stall": (
        CHAT,
        chat(stop=[f"s{i:05d}abcdefghijklmnopqrstuvwxyz0123456789" for i in range(20_000)]),
    ),
}


def child_log_path() -> Path:
    return engine_home() / "logs" / f"{ENGINE}--{NAME}.log"


@dataclass
class Served:
    """The module's gateway, replaced when a case has left its child broken."""

    logs_dir: Path
    gateway: EngineGateway | None = None
    broken: bool = field(default=True)

    def ready(self) -> EngineGateway:
        if self.gateway is None or self.broken:
            if self.gateway is not None:
                self.gateway.stop()
            self.gateway = start_engine_gateway(self.logs_dir, "--served-name", NAME)
            self.broken = False
        return self.gateway

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()


@pytest.fixture(scope="module")
def served(engine_installed: None, logs_dir: Path) -> Iterator[Served]:
    holder = Served(logs_dir)
    yield holder
    holder.close()


@pytest.fixture
def gateway(served: Served) -> Iterator[EngineGateway]:
    """The gateway for one case; marked broken unless the case ends with the child proven well."""
    gw = served.ready()
    served.broken = True
    yield gw


def child_pid(gw: EngineGateway) -> int:
    """The pid of the child the gateway last said was ready."""
    matches = ENGINE_READY.findall(gw.log())
    assert matches, gw.log()
    return int(matches[-1][0])


def log_from(offset: int) -> str:
    with child_log_path().open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


@dataclass
class Outcome:
    """What one hostile request did, gathered before anything is asserted."""

    status: int | None = None
    reply: str = ""
    follow_up_status: int | None = None
    follow_up_content: str = ""
    thread_died: bool = False
    pid_before: int = 0
    pid_after: int = 0
    child_alive: bool = False
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return (
            f"status {self.status} {self.reply[:300]!r}; next request {self.follow_up_status}; "
            f"thread died {self.thread_died}; pid {self.pid_before} -> {self.pid_after} "
            f"(alive {self.child_alive}); {'; '.join(self.notes)}"
        )


def send_then_check(gw: EngineGateway, path: str, body: dict[str, Any]) -> Outcome:
    """Send ``body``, then an ordinary chat request; note what became of the child."""
    outcome = Outcome(pid_before=child_pid(gw))
    offset = child_log_path().stat().st_size
    with httpx.Client(trust_env=False, timeout=_ANSWER_S) as http:
        try:
            response = http.post(gw.url + path, json=body)
            outcome.status, outcome.reply = response.status_code, response.text
        except httpx.TimeoutException:
            outcome.notes.append(f"no answer within {_ANSWER_S:g} s")
        time.sleep(0.5)  # a thread that dies logs it as the reply goes out
        normal = {"model": NAME, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4}
        try:
            after = http.post(gw.url + CHAT, json=normal)
            outcome.follow_up_status = after.status_code
            if after.status_code == 200:
                outcome.follow_up_content = after.json()["choices"][0]["message"]["content"] or ""
            else:
                outcome.notes.append(f"next request got {after.text[:200]!r}")
        except httpx.TimeoutException:
            outcome.notes.append(f"the next request got no answer within {_ANSWER_S:g} s")
    outcome.thread_died = _THREAD_DIED in log_from(offset)
    outcome.pid_after = child_pid(gw)
    outcome.child_alive = pid_alive(outcome.pid_after)
    return outcome


def assert_refused(outcome: Outcome) -> None:
    """A 4xx in OpenAI's envelope; not 404 (mlx's own answer once its thread is dead)."""
    assert outcome.status is not None and 400 <= outcome.status < 500, str(outcome)
    assert outcome.status not in (404, 408, 429), str(outcome)
    assert _THREAD_DIED not in outcome.reply, str(outcome)


def assert_engine_serves_on(outcome: Outcome) -> None:
    assert outcome.follow_up_status == 200 and outcome.follow_up_content, str(outcome)
    assert not outcome.thread_died, str(outcome)
    assert outcome.pid_after == outcome.pid_before and outcome.child_alive, str(outcome)


@pytest.mark.parametrize(("path", "body"), list(KILLERS.values()), ids=list(KILLERS))
def test_a_body_that_would_break_mlx_gets_a_4xx_and_the_engine_serves_on(
    served: Served, gateway: EngineGateway, path: str, body: dict[str, Any]
) -> None:
    """The body gets a 4xx in OpenAI's error envelope, and the same child answers the next request."""
    outcome = send_then_check(gateway, path, body)
    assert_refused(outcome)
    error = json.loads(outcome.reply)["error"]
    assert isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error), outcome.reply
    assert isinstance(error["message"], str) and error["message"], outcome.reply
    assert_engine_serves_on(outcome)
    served.broken = False


def _one_ascii_token_continuation(http: httpx.Client, gw: EngineGateway) -> tuple[str, str]:
    """A prompt whose greedy 1-token completion is one printable ASCII character, and that character.

    The tiny model's tokenizer is byte-level, so prompt + character encodes to
    the prompt's tokens plus the generated one.
    """
    for prompt in ("The quick brown fox", "Hello", "Once upon a time", "abc", "1, 2, 3,"):
        reply = http.post(gw.url + TEXT, json=text(prompt=prompt, max_tokens=1, temperature=0))
        assert reply.status_code == 200, reply.text
        generated = reply.json()["choices"][0]["text"]
        if len(generated) == 1 and generated.isascii() and generated.isprintable():
            return prompt, generated
    pytest.skip("no prompt tried gave a one-character ASCII completion")


def test_a_completion_that_continues_an_earlier_one_exactly_leaves_mlx_serving(
    served: Served, gateway: EngineGateway
) -> None:
    """A prompt equal to an earlier prompt plus its generated token (an exact prompt-cache hit) is served."""
    with httpx.Client(trust_env=False, timeout=_ANSWER_S) as http:
        prompt, generated = _one_ascii_token_continuation(http, gateway)
    # mlx keeps the cache of prompt + generated token under exactly those tokens; an exact hit
    # leaves nothing to prefill, and BatchGenerator.insert_segments raises on the empty rest
    # (engines/mlx_lm_server.py trims the hit by one token, which it prefills).
    outcome = send_then_check(gateway, TEXT, text(prompt=prompt + generated, max_tokens=3, temperature=0))
    assert outcome.status == 200, str(outcome)
    assert_engine_serves_on(outcome)
    served.broken = False
