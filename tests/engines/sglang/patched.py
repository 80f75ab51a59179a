"""``refcache``'s command line with one zoo bug patched into SGLang 0.5.20 (``sglang_zoo.SGLANG_ZOO``):

    PYTHONPATH=.:tests python -m engines.sglang.patched SLUG COMMAND [ARGS ...]

imports SGLang's modules behind the adapter's shim, applies the bug's source patch to SGLang's
``HiRadixCache`` (here and in the rank workers of a two-rank system, ``zoo_on_sglang.applied_everywhere``)
and runs ``refcache COMMAND ARGS`` in this process, so that ``record``, ``replay`` and
``shrink`` all drive the patched engine (docs/walkthrough-sglang.md). Nothing else differs from ``refcache``.
"""

from __future__ import annotations

import sys

from refcache.cli import app

from .sglang_zoo import SGLANG_ZOO
from .zoo_on_sglang import applied_everywhere, sglang_ready


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in SGLANG_ZOO:
        raise SystemExit(
            f"usage: python -m engines.sglang.patched SLUG COMMAND ...; SLUG one of {sorted(SGLANG_ZOO)}"
        )
    sglang_ready()
    with applied_everywhere(SGLANG_ZOO[argv[0]]):
        app(argv[1:], prog_name="refcache")


if __name__ == "__main__":
    main(sys.argv[1:])
