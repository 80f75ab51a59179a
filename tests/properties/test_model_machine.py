"""The model alone under random operation sequences: every invariant after every step (1, 2, 4 ranks)."""

from __future__ import annotations

from refcache.check import budget
from refcache.check.machines import FaultyModelMachine, ModelMachine

TestModelMachine = ModelMachine.TestCase
TestModelMachine.settings = budget.MODEL.settings()

TestFaultyModelMachine = FaultyModelMachine.TestCase
TestFaultyModelMachine.settings = budget.MODEL.settings()
