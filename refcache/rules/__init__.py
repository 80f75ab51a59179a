"""Each engine family's checking side, one module per family, above ``refcache.check``.

A module here holds what the generic checking side (``refcache.check``) runs for one family, and exports it as
one ``CHECKS`` (``refcache.check.families.FamilyChecks``), which ``refcache.check.families.FAMILIES`` names as
"module:attribute" and imports on first use:

* ``hicache`` — HiCache's registration: its own machines (``refcache.check.machines``, which stay in the
  checking side with its situations, so that its derandomized samples stay as they are) given as factories;
* ``vllm`` — vLLM's ``Rules`` (configurations, kinds, per-step draws), its situations and ledger report;
* ``lmcache`` — LMCache's ``Rules`` and ledger report.

The package is named for what most of it is: the rules a family's random machine draws by
(``refcache.check.machine.Rules``), beside the mechanism that runs them. It imports the checking side and the
family vocabularies; ``refcache.check`` imports none of it (import-linter), so the checking side names no
family. A family outside refcache registers its own module through the entry-point group
``refcache.families`` instead (``refcache.check.families.ENTRY_POINT_GROUP``).
"""
