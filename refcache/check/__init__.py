"""The checking side: everything that drives systems and judges them (the 19 modules below).

Driving and judging:

* ``harness`` — ``Harness.step(op)``: one operation applied to every system, outcomes and snapshots
  compared, every invariant checked; ``Divergence`` with the trace on the first failure.
* ``families`` — what the checking side adds to each engine family (``refcache.family``): its machines, the
  zoo's hunting machine, its coverage report, replay and shrink typed over its own types; the registry
  (``FAMILIES``: "module:attribute" strings, and the ``refcache.families`` entry points) that finds a
  family's checks by a system's or a trace's family.
* ``machine`` — ``FamilyMachine[Op, Obs, Snap]``, the plumbing every family's random machine shares, and
  ``family_machine``, the one machine over a family's ``Rules`` (data and draw functions);
  ``machines`` — the HiCache family's own machine, parametrised by the systems it drives. Every other
  family's ``Rules``, and every family's registration, live above this package (``refcache.rules``), found
  through ``families.FAMILIES`` by name.
* ``configs`` — configuration strategies; ``budget`` — example budgets, in one place.
* ``situations`` — the named circumstances where real HiCache bugs live, recognised from outside a system;
  ``coverage`` — the ledger of states, transitions, tables and situations a run reached.

Running, and after a failure:

* ``plan`` — what a command's options mean for the systems named (``ConfigOverrides``, ``FuzzPlan``);
  ``run`` — ``run_machines``: the machines for a budget of examples or of time (``refcache fuzz``);
  ``parallel`` — a plan in one process or in N worker processes with one budget (``refcache fuzz --jobs N``).
* ``shrink`` — ddmin over a failing trace's operations.
* ``explain`` — is a divergence a bug, or a place where a decision of ``specs/decisions.md`` chose otherwise
  than SGLang 0.5.20 (each decision's fidelity option tried in turn)?
* ``recorded`` — a recorded trace (``refcache.hicache.recording``) replayed on systems: where the engine left the
  spec.
* ``known`` — known findings as data (specs/sglang-known.json): a divergence matched to an engine's known bug
  (``refcache fuzz --known`` goes on past it, ``refcache replay --known`` names it).
* ``bisect`` — a trace replayed, or a fuzz budget spent, on each release of an engine in a cached environment
  per release (``refcache bisect``).
* ``generate`` — a seeded random operation stream without Hypothesis (benchmarks, soak runs).

Exhaustively, to a bound:

* ``enabled`` — what is enabled in a HiCache state, one function the machines and the explorer share;
  ``explore`` — breadth-first search of the model's states on a small configuration, every invariant on every
  state and transition, states merged by a canonical form (``refcache explore``).

Systems are opened by name through ``refcache.systems``; nothing here imports an engine directly.
"""
