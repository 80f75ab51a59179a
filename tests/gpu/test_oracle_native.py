"""The content oracle's C path (``refcache/gpu/csrc/oracle.c``) against its torch path, which is the reference:
the same bytes stored, the same verdict and message on an intact and on a corrupted read (device hit and
load-back, ``full`` and ``sampled``), the same chain states; and deliberately broken copies of the C source,
built by the test, are caught by those comparisons."""

from __future__ import annotations

import platform
import random
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refcache.config import AttentionKind, HiCacheConfig
from refcache.errors import CorruptionError
from refcache.gpu import native
from refcache.gpu.device_pool import KVCache, device_pool_from_config
from refcache.gpu.kv_oracle import (
    _DIFFERS,
    _PASS,
    KVOracle,
    NativeDisagreement,
    OracleMode,
    _COracle,
)

DTYPES = ["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"]


@dataclass(frozen=True)
class Case:
    """One store, then an intact and a corrupted read of the same slots, on one rank's pool."""

    config: HiCacheConfig
    rank: int
    mode: OracleMode
    slots: tuple[int, ...]  # distinct
    tokens: tuple[int, ...]  # the key whose seeds are stored
    corrupt: tuple[
        int, int, int, int, int
    ]  # (K/V, layer, position in the read, element of the row, xor bits)


def _case(rng: random.Random, dtype: str | None = None, mode: OracleMode | None = None) -> Case:
    mla = rng.random() < 0.4
    layers = rng.randint(1, 3)
    if mla:
        config = HiCacheConfig(
            attention=AttentionKind.MLA,
            layer_num=layers,
            kv_lora_rank=rng.choice([4, 8, 16, 32]),
            qk_rope_head_dim=rng.choice([2, 4, 8]),
            dtype=dtype or rng.choice(DTYPES),
            device_size=64,
            page_size=1,
        )
    else:
        config = HiCacheConfig(
            layer_num=layers,
            head_num=rng.randint(1, 3),
            head_dim=rng.choice([2, 4, 8, 16]),
            tp_size=2,
            dtype=dtype or rng.choice(DTYPES),
            device_size=64,
            page_size=1,
        )
    n = rng.randint(1, 40)
    slots = tuple(rng.sample(range(64), n))
    tokens = tuple(rng.randrange(1 << 20) for _ in range(n))
    num_kv = 1 if mla else 2
    width = (config.kv_lora_rank + config.qk_rope_head_dim) if mla else config.head_num * config.head_dim
    size = torch.empty(0, dtype=getattr(torch, config.dtype)).element_size()
    corrupt = (
        rng.randrange(num_kv),
        rng.randrange(layers),
        rng.randrange(n),
        rng.randrange(width),
        rng.randrange(1, 1 << (8 * size)),
    )
    modes: list[OracleMode] = ["full", "sampled"]
    return Case(
        config, rng.randrange(2), mode if mode is not None else rng.choice(modes), slots, tokens, corrupt
    )


def _outcome(run: object) -> tuple[str, str] | None:
    try:
        run()  # type: ignore[operator]
    except CorruptionError as error:
        return "corrupt", str(error)
    except NativeDisagreement:
        return "disagree", ""
    return None


def _observe(case: Case, c: _COracle | None) -> list[object]:
    """What one oracle (C path ``c``, or torch when None) does in ``case``: the stored bytes and the
    outcome of each read, intact then corrupted."""
    oracle = KVOracle(case.config, case.rank, case.mode)
    oracle._c = c
    pool = device_pool_from_config(case.config, "cpu")
    pool.poison(torch.arange(pool.size))
    slots = torch.tensor(case.slots, dtype=torch.int64)
    seeds = oracle.seeds(None, list(case.tokens))
    what = [f"node{i}" for i in range(len(slots))]
    if c is not None:  # the C path itself stores, passes the intact read and finds a sampled corruption
        assert oracle._store_c(pool, slots, seeds) is True
    oracle.write_device(pool, slots, seeds)
    seen: list[object] = [_raw(pool).clone()]
    for verdict in (_PASS, _DIFFERS if _sampled(case) else _PASS):  # intact, then corrupted
        if c is not None:
            buffers: list[tuple[torch.Tensor, ...]] = [
                (pool.get_key_buffer(layer),) if pool.num_kv == 1 else pool.get_kv_buffer(layer)
                for layer in range(pool.layer_num)
            ]
            assert oracle._check_c(pool, buffers, slots, seeds) == verdict, "the C check's verdict"
            assert oracle._check_layers_c(pool, slots, seeds) == verdict, "the C load-back check's verdict"
        seen.append(_outcome(lambda: oracle.check_device(pool, slots, seeds, what)))
        seen.append(_outcome(lambda: oracle.check_device_layers(pool, slots, seeds, what)))
        kv, layer, position, element, bits = case.corrupt
        row = _raw(pool).view(pool.num_kv, pool.layer_num, pool.size, -1)[kv, layer, case.slots[position]]
        row[element] ^= bits
    oracle.poison(pool, slots[::2])  # freed slots: every layer NaN
    seen.append(_raw(pool).clone())
    return seen


def _raw(pool: KVCache) -> torch.Tensor:
    size = pool.kv_buffer.element_size()
    return pool.kv_buffer.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[size])


def _agree(case: Case, c: _COracle) -> None:
    """The C path does what the torch path does in ``case`` (an AssertionError naming the difference)."""
    want, got = _observe(case, None), _observe(case, c)
    assert isinstance(want[0], torch.Tensor) and isinstance(got[0], torch.Tensor)
    assert torch.equal(got[0], want[0]), "the C store wrote other bytes than the torch store"
    assert want[1] is None and want[2] is None  # the torch path passes the intact read...
    assert (want[3] is not None) == _sampled(case)  # ...and catches the corruption where it samples
    assert got[1:-1] == want[1:-1], f"C {got[1:-1]} != torch {want[1:-1]}"
    assert isinstance(want[-1], torch.Tensor) and isinstance(got[-1], torch.Tensor)
    assert torch.equal(got[-1], want[-1]), "the C poisoning wrote other bytes than the torch one"


def _sampled(case: Case) -> bool:
    """Whether the corrupted position of ``case`` is one its oracle mode checks."""
    position, n = case.corrupt[2], len(case.slots)
    return case.mode == "full" or n <= 2 or position == n - 1 or position % 8 == 0


def _guarded(pool: KVCache) -> torch.Tensor:
    """Moves ``pool``'s allocation into the middle third of a larger backing tensor (returned): a write
    before or after the allocation changes the backing's first or last third."""
    n = pool.kv_buffer.numel()
    backing = torch.zeros(3 * n, dtype=pool.kv_buffer.dtype)
    pool.kv_buffer = backing[n : 2 * n].view(pool.kv_buffer.shape)
    return backing


def _bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).clone()


def _bounds_hold(c: _COracle) -> None:
    """The C entry points, called directly, refuse (-1) rows beyond the pool's and slots outside
    [0, size), and write nothing: not a byte of the pool, nor of the memory around it, changes."""
    config = HiCacheConfig(layer_num=2, head_num=2, head_dim=8, tp_size=1, device_size=16, page_size=1)
    oracle = KVOracle(config, 0)
    oracle._c = c
    pool = device_pool_from_config(config, "cpu")
    backing = _guarded(pool)
    cp = oracle._c_pool(pool)
    assert cp is not None
    rows, size = 2 * config.layer_num, pool.size
    before = _bits_of(backing)
    seeds = torch.tensor([5, 7], dtype=torch.int32)

    def refused(slots: list[int], row_begin: int, row_end: int, store_rows: int) -> None:
        index = torch.tensor(slots, dtype=torch.int64)
        at, n, seed = index.data_ptr(), len(slots), seeds.data_ptr()
        assert c.check(cp.g, row_begin, row_end, at, n, 1, seed) == -1, (slots, row_begin, row_end)
        assert c.store(cp.g, store_rows, at, n, seed) == -1, (slots, store_rows)
        assert c.fill(cp.g, store_rows, at, n, cp.nan.data_ptr()) == -1, (slots, store_rows)
        assert torch.equal(_bits_of(backing), before), "a refused call wrote memory"

    refused([size - 1, 0], 0, rows + 1, rows + 1)  # a row beyond the pool's
    refused([size - 1, 0], -1, rows, rows + 1)
    refused([size - 1, 0], 2, 1, rows + 1)
    refused([0, size], 0, rows, rows)  # a slot equal to the size
    refused([-1, 0], 0, rows, rows)
    index = torch.tensor([size - 1, 0], dtype=torch.int64)  # and in range they do run
    assert c.store(cp.g, rows, index.data_ptr(), 2, seeds.data_ptr()) == 0
    assert c.check(cp.g, 0, rows, index.data_ptr(), 2, 1, seeds.data_ptr()) == -2
    assert c.fill(cp.g, rows, index.data_ptr(), 2, cp.nan.data_ptr()) == 0


def _chain_agrees(c: _COracle, rng: random.Random) -> None:
    config = HiCacheConfig()
    torch_oracle, c_oracle = KVOracle(config, 0), KVOracle(config, 0)
    torch_oracle._c, c_oracle._c = None, c
    for _ in range(20):
        n = rng.randint(0, 30)
        bigram = rng.random() < 0.3
        elements = [
            (rng.randrange(1 << 30), rng.randrange(1 << 30)) if bigram else rng.randrange(1 << 62)
            for _ in range(n)
        ]
        tail = [rng.randrange(1 << 20) for _ in range(rng.randint(0, 2))]
        state, position = rng.randrange(1 << 64), rng.randrange(5000)
        want = torch_oracle.advance(state, elements, tail, position)
        got = c_oracle.advance(state, elements, tail, position)
        assert got.tolist() == want.tolist(), "the C chain differs from numpy's"
        states, seeds = c_oracle.advance_seeds(state, elements, tail, position)
        assert states.tolist() == want.tolist()
        assert torch.equal(seeds, torch_oracle.seeds_of(want)), "the C seeds differ from seeds_of's"


# The builds of oracle.c the tests run: the default (AVX2 blocks where the CPU has them, as production
# loads it) and the plain loops alone (what other machines run).
BUILDS: dict[str, dict[str, int]] = {"default": {}, "plain": {"ORACLE_SIMD": 0}}


def _lib(build: str = "default") -> _COracle:
    lib = native.load("oracle", defines=BUILDS[build])
    if lib is None:
        pytest.skip(f"no C oracle: {native.why_not('oracle')}")
    return _COracle(lib)


@pytest.mark.parametrize("build", sorted(BUILDS))
@settings(max_examples=80, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_the_c_path_does_what_the_torch_path_does(build: str, rng: random.Random) -> None:
    _agree(_case(rng), _lib(build))


@pytest.mark.parametrize("build", sorted(BUILDS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_agrees(dtype: str, build: str) -> None:
    rng = random.Random(dtype)
    for _ in range(6):
        _agree(_case(rng, dtype), _lib(build))


@settings(max_examples=20, deadline=None)
@given(st.randoms(use_true_random=False))
def test_the_c_chain_is_numpys(rng: random.Random) -> None:
    _chain_agrees(_lib(), rng)


def test_an_oracle_uses_the_c_path_unless_native_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    _lib()
    assert KVOracle(HiCacheConfig(), 0)._c is not None
    assert KVOracle(HiCacheConfig(), 0, "off")._c is None  # "off" runs no oracle code at all
    monkeypatch.setenv(native.NATIVE_ENV, "off")
    assert KVOracle(HiCacheConfig(), 0)._c is None


class Mutant(NamedTuple):
    """A deliberately broken copy of oracle.c: ``old`` replaced by ``new`` (its ``occurrence``-th
    appearance, or every one for 0), in the code that ``build`` runs."""

    old: str
    new: str
    occurrence: int = 0
    build: str = "plain"


# Each must fail the comparisons above (or the direct calls of _bounds_hold) on some of the fixed cases.
MUTANTS = {
    "check-skips-last-element": Mutant("e = 0; e < width; e++) diff", "e = 0; e < width - 1; e++) diff"),
    "wrong-shift": Mutant("(uint32_t)(m)) >> 28)", "(uint32_t)(m)) >> 27)"),
    "check-ignores-the-row-in-multipliers": Mutant("*m = mult + r * width;", "*m = mult;", 1),
    "store-ignores-the-row-in-multipliers": Mutant("*m = mult + r * width;", "*m = mult;", 2),
    "wrong-sampling": Mutant("i % stride == 0", "i % stride == 1"),
    "first-position-unchecked": Mutant("if (diff) return i;", "if (diff && i > 0) return i;"),
    "chain-ignores-position": Mutant("mix((position + (uint64_t)i) ^ key)", "mix((uint64_t)i ^ key)"),
    "fill-skips-a-row": Mutant("i < n; i++) memcpy", "i < n * (r > 0); i++) memcpy"),
    "chain-seeds-low-half": Mutant("(int32_t)(uint32_t)(state >> 32)", "(int32_t)(uint32_t)(state >> 31)"),
    "slot-equal-to-size-in-range": Mutant("slots[i] >= size", "slots[i] > size"),
    "store-and-fill-rows-unchecked": Mutant("if (rows > g[G_ROWS] || !width_fits(g))", "if (!width_fits(g))"),
    "check-rows-unchecked": Mutant("row_end > g[G_ROWS] || ", ""),
    # the AVX2 blocks
    "simd-lane-order": Mutant("(a, b), 0xD8)", "(a, b), 0xE4)", 0, "default"),
    "simd-check-ignores-blocks": Mutant("diff || !TESTZ(acc)", "diff", 0, "default"),
    "simd-u32-blend": Mutant("_mm256_set1_epi32(7)", "_mm256_set1_epi32(8)", 0, "default"),
    "simd-u16-high-byte": Mutant("(hi, idx), 8)", "(hi, idx), 0)", 0, "default"),
    "simd-u8-low-byte": Mutant("_mm256_set1_epi16(0xFF)", "_mm256_set1_epi16(0xFE)", 2, "default"),
}


def _fixed_cases() -> list[Case]:
    cases = []
    # targeted: a corruption in a row's last element, at position 0, at a sampled position 8
    # (a row of 8 elements: the plain loops; of 16 fp16, 8 + 4 fp32 or 16 fp8: the AVX2 blocks and tails)
    for head_dim, dtype in ((4, "float16"), (8, "float16"), (6, "float32"), (8, "float8_e5m2")):
        base = HiCacheConfig(
            layer_num=2, head_num=2, head_dim=head_dim, tp_size=2, device_size=64, page_size=1, dtype=dtype
        )
        last = 2 * head_dim - 1
        cases.append(Case(base, 1, "full", tuple(range(3, 23)), tuple(range(20)), (1, 1, 4, last, 1)))
        cases.append(Case(base, 0, "full", tuple(range(3, 23)), tuple(range(20)), (0, 0, 0, 0, 1)))
        cases.append(Case(base, 0, "sampled", tuple(range(3, 23)), tuple(range(20)), (0, 1, 8, 2, 3)))
    rng = random.Random(17)
    return cases + [
        _case(rng, dtype, mode) for dtype in DTYPES for mode in ("full", "sampled") for _ in range(3)
    ]


def _replace(text: str, old: str, new: str, occurrence: int) -> str:
    assert old in text, f"the mutation's text is not in oracle.c: {old!r}"
    if occurrence == 0:
        return text.replace(old, new)
    at = -1
    for _ in range(occurrence):
        at = text.index(old, at + 1)
    return text[:at] + new + text[at + len(old) :]


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_the_fixed_cases_pass_on_the_real_c(build: str) -> None:
    _all_agree(_lib(build))


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_broken_c_oracle_is_caught(mutant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _lib()
    old, new, occurrence, build = MUTANTS[mutant]
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "oracle.c").write_text(_replace(native.source("oracle").read_text(), old, new, occurrence))
    monkeypatch.setattr(native, "_SOURCES", src)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    c = _lib(build)
    if build == "default" and not c.simd():
        pytest.skip("the plain loops run here (no AVX2): the mutated blocks never run")
    with pytest.raises(AssertionError):
        _all_agree(c)


def _all_agree(c: _COracle) -> None:
    _bounds_hold(c)
    _chain_agrees(c, random.Random(17))
    for case in _fixed_cases():
        _agree(case, c)


def test_the_default_build_runs_the_avx2_blocks_where_the_cpu_has_them() -> None:
    """Else the blocks, and the mutants of them above, would silently never run on such a machine."""
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() not in ("x86_64", "AMD64") or not cpuinfo.exists():
        pytest.skip("not an x86-64 Linux machine")
    flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    assert _lib().simd() == ("avx2" in flags.split())
    assert _lib("plain").simd() == 0


def _outcome_of(run: object) -> tuple[type, str] | None:
    """The exception ``run`` raises, as (type, message), or None."""
    try:
        run()  # type: ignore[operator]
    except Exception as error:  # any exception: both paths must raise the same
        return type(error), str(error)
    return None


def _outcomes(
    oracle: KVOracle, pool: KVCache, slots: torch.Tensor, seeds: torch.Tensor
) -> tuple[tuple[type, str] | None, ...]:
    """What a store, a device-hit check, a load-back check and a poisoning of ``slots`` raise."""
    what = [f"node{i}" for i in range(len(seeds))]
    return (
        _outcome_of(lambda: oracle.write_device(pool, slots, seeds)),
        _outcome_of(lambda: oracle.check_device(pool, slots, seeds, what)),
        _outcome_of(lambda: oracle.check_device_layers(pool, slots, seeds, what)),
        _outcome_of(lambda: oracle.poison(pool, slots)),
    )


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_a_pool_of_another_shape_is_refused_on_both_paths_and_nothing_around_it_changes() -> None:
    """An oracle of 4 layers x 4 heads on a pool of 2 layers x 8 heads (the same element count per slot):
    the C path declines the pool, the torch path raises its own errors, and no byte around the pool
    changes (the pool lies in the middle third of a larger tensor; a poisoning is the pool's own, of its
    own shape)."""
    oracle_config = HiCacheConfig(layer_num=4, head_num=4, head_dim=8, tp_size=1, device_size=64, page_size=1)
    pool_config = HiCacheConfig(layer_num=2, head_num=8, head_dim=8, tp_size=1, device_size=64, page_size=1)
    seen = []
    for c in (None, _lib()):
        oracle = KVOracle(oracle_config, 0)
        oracle._c = c
        pool = device_pool_from_config(pool_config, "cpu")
        backing = _guarded(pool)
        n = pool.kv_buffer.numel()
        before = _bits_of(backing)
        slots = torch.tensor([63], dtype=torch.int64)
        seeds = oracle.seeds(None, [1])
        outcomes = _outcomes(oracle, pool, slots, seeds)
        after = _bits_of(backing)
        assert torch.equal(after[:n], before[:n]), "a write before the pool"
        assert torch.equal(after[2 * n :], before[2 * n :]), "a write after the pool"
        assert all(outcome is not None for outcome in outcomes[:3]), outcomes
        seen.append((outcomes, after.tolist()))
    assert seen[1] == seen[0]


@pytest.mark.parametrize("kind", ["float", "int32", "uint8", "2-D"])
def test_slots_torch_rejects_are_rejected_on_both_paths(kind: str) -> None:
    """The C path declines slots that are not a 1-D int64 tensor: the torch path then raises what it
    raises (on int32 slots, which torch indexes with, the checks of the slots the store refused fail), so
    both paths raise the same exceptions with the same messages and leave the same bytes."""
    config = HiCacheConfig(layer_num=2, head_num=2, head_dim=8, tp_size=1, device_size=16, page_size=1)
    slots = {
        "float": torch.tensor([3.0, 5.0]),
        "int32": torch.tensor([3, 5], dtype=torch.int32),
        "uint8": torch.tensor([3, 5], dtype=torch.uint8),
        "2-D": torch.tensor([[3], [5]]),
    }[kind]
    seen: list[tuple[tuple[tuple[type, str] | None, ...], list[object]]] = []
    for c in (None, _lib()):
        oracle = KVOracle(config, 0)
        oracle._c = c
        pool = device_pool_from_config(config, "cpu")
        seeds = oracle.seeds(None, [1, 2])
        seen.append((_outcomes(oracle, pool, slots, seeds), _bits_of(pool.kv_buffer).tolist()))
    outcomes = seen[0][0]
    assert None not in outcomes, outcomes  # torch raises on each...
    assert seen[1] == seen[0]  # ...and the C path ends alike


@pytest.mark.parametrize("element", [-1, 1 << 64])
def test_a_chain_element_out_of_range_raises_as_numpy_does(element: int) -> None:
    """An element outside [0, 2**64): the C path hands the chain to numpy, which raises its error."""
    torch_oracle, c_oracle = KVOracle(HiCacheConfig(), 0), KVOracle(HiCacheConfig(), 0)
    torch_oracle._c, c_oracle._c = None, _lib()
    for oracle in (torch_oracle, c_oracle):
        assert oracle.advance(1, [5, 6]).tolist() == torch_oracle.advance(1, [5, 6]).tolist()
    want = _outcome_of(lambda: torch_oracle.advance(1, [5, element]))
    assert want is not None and want[0] is OverflowError
    assert _outcome_of(lambda: c_oracle.advance(1, [5, element])) == want
    assert _outcome_of(lambda: c_oracle.advance_seeds(1, [5, element])) == want
