"""engines.served: the model lifecycle as data (ModelState, TRANSITIONS), and what a model does alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.child import Child
from engines.registry import Registry
from engines.served import HOLDING, TRANSITIONS, Lifetime, ModelState, ServedModel
from tests.engines.test_child import config

S = ModelState

# The moves drawn in engines/DESIGN.md's "Models" diagram.
DIAGRAM = [
    (S.UNLOADED, S.LOADING),  # load, or an eager start
    (S.LOADING, S.LOADED),  # a replica is ready
    (S.LOADED, S.UNLOADING),  # unload by hand: drain first
    (S.UNLOADING, S.STOPPING),  # drained
    (S.STOPPING, S.UNLOADED),  # the children have exited
    (S.LOADED, S.STOPPING),  # idle past its TTL, or displaced by --max-loaded
    (S.LOADING, S.STOPPING),  # the load or the start failed
    (S.LOADED, S.LOADING),  # a load waits for a restarting replica
    (S.UNLOADING, S.LOADING),  # asked for again while draining
    (S.UNLOADING, S.LOADED),  # still busy after the unload wait: stays
]


def model(tmp_path: Path, **options: object) -> ServedModel:
    return ServedModel("m", [Child(config(tmp_path))], **options)  # type: ignore[arg-type]


def test_every_state_has_a_row() -> None:
    """TRANSITIONS has exactly one row per ModelState."""
    assert set(TRANSITIONS) == set(ModelState)


def test_moves_stay_within_the_enum() -> None:
    """Every target of every move is a ModelState."""
    for targets in TRANSITIONS.values():
        assert targets <= set(ModelState)


@pytest.mark.parametrize(("start", "end"), DIAGRAM, ids=lambda s: s.value)
def test_the_diagram_s_moves_are_allowed(start: ModelState, end: ModelState) -> None:
    """Each move the design note draws is in the table."""
    assert end in TRANSITIONS[start]


def test_retired_is_final() -> None:
    """RETIRED has no moves out: a replaced model never serves again."""
    assert TRANSITIONS[S.RETIRED] == frozenset()


@pytest.mark.parametrize("state", [s for s in ModelState if s is not S.RETIRED], ids=lambda s: s.value)
def test_every_other_state_can_retire(state: ModelState) -> None:
    """A reload or a shutdown can retire a model whatever it is doing."""
    assert S.RETIRED in TRANSITIONS[state]


def test_no_state_moves_to_itself() -> None:
    """A move always changes the state."""
    for state, targets in TRANSITIONS.items():
        assert state not in targets


def test_a_stop_under_way_only_ends() -> None:
    """STOPPING goes only to UNLOADED (or RETIRED): a load waits for the stop, never revives it midway."""
    assert TRANSITIONS[S.STOPPING] == frozenset({S.UNLOADED, S.RETIRED})


def test_unloaded_cannot_serve_without_loading() -> None:
    """UNLOADED cannot go straight to LOADED: a slot is only taken by a load or a start."""
    assert S.LOADED not in TRANSITIONS[S.UNLOADED]
    assert S.UNLOADED not in TRANSITIONS[S.LOADED], "children are stopped on the way: through STOPPING"


def test_only_loading_and_loaded_hold_a_slot() -> None:
    """The --max-loaded count is of LOADING and LOADED models; one that unloads gave its slot up."""
    assert frozenset({S.LOADING, S.LOADED}) == HOLDING


def test_the_state_values_are_the_names_shown_for_the_same_meaning() -> None:
    """States that users also see keep the values /v1/models uses for them."""
    assert (S.UNLOADED.value, S.LOADING.value, S.LOADED.value, S.UNLOADING.value) == (
        "unloaded",
        "loading",
        "loaded",
        "unloading",
    )


def test_a_new_model_is_unloaded_and_not_ready(tmp_path: Path) -> None:
    """A model starts UNLOADED: not ready, shown as unloaded, running nothing."""
    served = model(tmp_path)
    assert served.lifecycle is S.UNLOADED
    assert not served.ready and served.state == "unloaded" and not served.running


def test_a_move_outside_the_table_is_refused(tmp_path: Path) -> None:
    """The one writer asserts each move: UNLOADED → LOADED is a bug, not a state."""
    served = model(tmp_path)
    with pytest.raises(AssertionError, match="UNLOADED → LOADED is not allowed"):
        served._move(S.LOADED)
    assert served.lifecycle is S.UNLOADED


def test_requests_in_flight_are_counted_and_make_the_model_busy(tmp_path: Path) -> None:
    """enter and leave bracket a request: busy while one is in flight, and each marks the model used."""
    served = model(tmp_path)
    before = served.last_used
    served.enter()
    assert served.busy and served.in_flight == 1 and served.last_used >= before
    served.leave()
    assert not served.busy


def test_the_lifetime_is_the_model_s_own_and_retuned_by_asking(tmp_path: Path) -> None:
    """retune replaces the lifetime (a reload); the model's state does not change."""
    served = model(tmp_path, lifetime=Lifetime(ttl_s=5))
    served.retune(Lifetime(always_loaded=True))
    assert served.lifetime == Lifetime(always_loaded=True)
    assert served.lifecycle is S.UNLOADED


def test_an_idle_model_that_is_not_loaded_does_not_expire(tmp_path: Path) -> None:
    """expire stops only a LOADED model: an unloaded one idle for ages has nothing to stop."""
    served = model(tmp_path, lifetime=Lifetime(ttl_s=0.001))
    assert served.expire(served.last_used + 3600) is None
    assert served.lifecycle is S.UNLOADED


def test_an_unloaded_model_is_not_evictable(tmp_path: Path) -> None:
    """Only a LOADED model can be displaced by another's load."""
    assert not model(tmp_path).evictable


@pytest.mark.anyio
async def test_a_model_without_a_keeper_says_it_cannot_load_or_unload(tmp_path: Path) -> None:
    """With no registry to ask for room, load and unload answer why; the model stays unloaded."""
    served = model(tmp_path)
    assert await served.load() == "model `m` has no registry to load it"
    assert await served.unload() == "model `m` has no registry to unload it"
    assert not await served.wait_ready(0)
    assert served.lifecycle is S.UNLOADED


@pytest.mark.anyio
async def test_a_model_out_of_its_registry_is_refused_a_load(tmp_path: Path) -> None:
    """A model made for a registry but not in it (a reload that did not take it) is refused by admit."""
    registry = Registry()
    served = model(tmp_path, keeper=registry)
    assert await served.load() == "model `m` was removed by a configuration reload; retry"
    assert served.lifecycle is S.UNLOADED and "removed by a configuration reload" in served.not_ready_reason()


@pytest.mark.anyio
async def test_a_retired_model_never_loads_again(tmp_path: Path) -> None:
    """shutdown retires the model for good; a later load is refused and its state stays RETIRED."""
    registry = Registry()
    served = model(tmp_path, keeper=registry)
    registry.add(served)
    await registry.shutdown()
    assert served.lifecycle is S.RETIRED
    assert await served.load() == "the gateway is shutting down"
    assert served.lifecycle is S.RETIRED and not served.ready


def test_a_registry_takes_only_the_models_made_for_it(tmp_path: Path) -> None:
    """A model whose keeper is another registry (or none) is refused: it would ask the wrong one for room."""
    mine, other = Registry(), Registry()
    with pytest.raises(ValueError, match="made for another registry"):
        mine.add(model(tmp_path, keeper=other))
    with pytest.raises(ValueError, match="made for another registry"):
        mine.add(model(tmp_path))
