"""The model alone under random operation sequences: every invariant after every step (1, 2, 4 ranks)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

from refcache.strategies import FaultyModelMachine, ModelMachine

_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestModelMachine = ModelMachine.TestCase
TestModelMachine.settings = _SETTINGS

TestFaultyModelMachine = FaultyModelMachine.TestCase
TestFaultyModelMachine.settings = _SETTINGS
