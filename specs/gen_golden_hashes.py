"""Generate ``specs/golden-hashes.json``: page-hash vectors computed without ``refcache.hashing``.

    python specs/gen_golden_hashes.py          # rewrite specs/golden-hashes.json
    python specs/gen_golden_hashes.py --check  # exit 1 if the committed file is stale

The scheme is re-derived here from reference/sglang.md §4.1 and §4.2 with nothing but ``hashlib`` and
``struct``, on purpose: ``tests/unit/test_hashing.py`` checks that ``refcache.hashing`` reproduces every
vector, so an error in either derivation shows up as a mismatch.

* page ``i``: ``digest_i = SHA256(raw 32 bytes of digest_{i-1}, absent for the first page, then every
  token of the page as uint32 little-endian)``; lower-case hex; a short last page hashes what it has;
* bigram mode (EAGLE): the key is the pairs ``(t0, t1), (t1, t2), ...`` and a pair contributes both ids;
* namespace (``extra_key``; ``cache_salt`` is always ``None`` here): the chain starts from
  ``SHA256(b"sglang-cache-namespace-v1" + part(extra_key) + part(None))`` where ``part(None) = b"\\x00"``
  and ``part(s) = b"\\x01" + len(utf8(s)) as 8-byte little-endian + utf8(s)``;
* storage key: ``hash + "_" + model_name with "/" replaced by "-"``, plus ``"_{tp_rank}_{tp_size}"``
  unless the model is MLA.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
from pathlib import Path
from typing import Final

__all__ = ["OUTPUT", "cases", "render"]

OUTPUT: Final = Path(__file__).with_name("golden-hashes.json")

_U32_MAX: Final = 2**32 - 1


def _namespace_part(part: str | None) -> bytes:
    if part is None:
        return b"\x00"
    data = part.encode("utf-8")
    return b"\x01" + struct.pack("<Q", len(data)) + data


def _namespace_seed(extra_key: str | None) -> bytes | None:
    """Raw 32-byte seed digest, or ``None`` for no namespace (cache_salt is never set here)."""
    if extra_key is None:
        return None
    return hashlib.sha256(
        b"sglang-cache-namespace-v1" + _namespace_part(extra_key) + _namespace_part(None)
    ).digest()


def _key(tokens: list[int], bigram: bool) -> list[tuple[int, ...]]:
    if bigram:
        return [(tokens[i], tokens[i + 1]) for i in range(len(tokens) - 1)]
    return [(t,) for t in tokens]


def _chain(tokens: list[int], page_size: int, extra_key: str | None, bigram: bool) -> list[str]:
    elements = _key(tokens, bigram)
    prior = _namespace_seed(extra_key)
    out: list[str] = []
    for start in range(0, len(elements), page_size):
        data = b"" if prior is None else prior
        for element in elements[start : start + page_size]:
            data += b"".join(struct.pack("<I", t) for t in element)
        digest = hashlib.sha256(data).digest()
        out.append(digest.hex())
        prior = digest
    return out


def _case(
    name: str,
    tokens: list[int],
    page_size: int,
    namespace: str | None = None,
    bigram: bool = False,
    *,
    model_name: str = "Qwen/Qwen3-8B",
    mla: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> dict[str, object]:
    keys = _chain(tokens, page_size, namespace, bigram)
    seed = _namespace_seed(namespace)
    suffix = "_" + model_name.replace("/", "-") + ("" if mla else f"_{tp_rank}_{tp_size}")
    return {
        "name": name,
        "tokens": tokens,
        "page_size": page_size,
        "namespace": namespace,
        "bigram": bigram,
        "namespace_seed": None if seed is None else seed.hex(),
        "keys": keys,
        "storage": {
            "model_name": model_name,
            "mla": mla,
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "keys": [k + suffix for k in keys],
        },
    }


def cases() -> list[dict[str, object]]:
    """Every golden case, in file order."""
    big = [_U32_MAX, _U32_MAX - 1, 2**31, 2**31 - 1, 0, 1, 2**16, 2**24 + 7]
    return [
        _case("single token, page 1", [0], 1),
        _case("page 1", [1, 2, 3, 4, 5], 1),
        _case("page 2", [1, 2, 3, 4, 5, 6], 2),
        _case("page 2, partial last page", [1, 2, 3, 4, 5], 2),
        _case("page 4", [10, 20, 30, 40, 50, 60, 70, 80], 4),
        _case("page 4, partial last page", [10, 20, 30, 40, 50, 60], 4),
        _case("page 4, namespace", [10, 20, 30, 40, 50, 60, 70, 80], 4, "lora-a"),
        _case("page 2, other namespace", [1, 2, 3, 4, 5, 6], 2, "tenant-b", tp_rank=1, tp_size=2),
        _case("page 1, non-ASCII namespace", [1, 2, 3], 1, "租户-ü", mla=True),
        _case("page 1, empty-string namespace", [1, 2, 3], 1, ""),
        _case("bigram, page 1", [1, 2, 3, 4, 5], 1, bigram=True),
        _case("bigram, page 2", [1, 2, 3, 4, 5, 6, 7], 2, bigram=True, mla=True),
        _case("bigram, page 2, namespace", [1, 2, 3, 4, 5, 6, 7], 2, "lora-a", True),
        _case("token ids near 2**32 - 1, page 1", big, 1, tp_rank=3, tp_size=4),
        _case("token ids near 2**32 - 1, page 4", big, 4, model_name="deepseek-ai/DeepSeek-V3", mla=True),
        _case("token ids near 2**32 - 1, bigram, page 2, namespace", big, 2, "lora-z", True),
    ]


def render() -> str:
    """The full text of ``specs/golden-hashes.json``: a JSON list of cases. In each, ``keys[i]`` is the
    chained SHA-256 of page ``i`` of the key (bigram pairs when ``bigram``), seeded by
    ``namespace_seed`` when ``namespace`` is not null; ``storage.keys`` adds the L3 key suffix."""
    text = json.dumps(cases(), indent=2, ensure_ascii=False)
    # Token lists on one line each; hashes stay one per line.
    text = re.sub(r"\[\s+([0-9][0-9,\s]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    return text + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            sys.stderr.write(f"{OUTPUT} is stale; run python specs/gen_golden_hashes.py\n")
            return 1
        return 0
    OUTPUT.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
