"""The checking side: everything that drives systems and judges them.

* ``harness`` — ``Harness.step(op)``: one operation applied to every system, outcomes and snapshots
  compared, every invariant checked; ``Divergence`` with the trace on the first failure.
* ``machines`` — the Hypothesis state machines, one family parametrised by the systems it drives.
* ``configs`` — configuration strategies; ``budget`` — example budgets, in one place.
* ``plan`` — what a command's options mean for the systems named (``ConfigOverrides``, ``FuzzPlan``);
  ``run`` and ``parallel`` run a plan for its budget, in one process or in workers.
* ``coverage`` — the ledger of states, transitions and tables a run reached.
* ``shrink`` — ddmin over a failing trace's operations.
* ``generate`` — a seeded random operation stream without Hypothesis (benchmarks, soak runs).

Systems are opened by name through ``refcache.systems``; nothing here imports an engine directly.
"""
