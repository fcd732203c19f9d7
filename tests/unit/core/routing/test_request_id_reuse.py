"""A route query whose request id was decided already: the same request gets the same
decision (a router's retry), another one (model or prompt length) is refused, never
answered with the first one's worker."""

from __future__ import annotations

import dataclasses

import pytest

from foretoken.core.routing.service import RequestIdReused
from tests.unit.core.routing.test_service import _predictor, _req


def test_a_retry_gets_the_same_decision_and_another_request_is_refused() -> None:
    p = _predictor(2)
    first = p.route(_req("a", tokens=64).query(), 0.0, 0.0)
    assert first.admitted
    assert p.route(_req("a", tokens=64).query(), 1.0, 1.0) is first
    with pytest.raises(RequestIdReused, match="another request"):
        p.route(_req("a", tokens=9000).query(), 1.0, 1.0)
    other_model = dataclasses.replace(_req("a", tokens=64).query(), model="other")
    with pytest.raises(RequestIdReused):
        p.route(other_model, 1.0, 1.0)
