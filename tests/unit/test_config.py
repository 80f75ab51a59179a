"""``HiCacheConfig``: the seed's defaults (§6), derived sizes, validation, rewrites and the JSON codec."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from refcache.config import (
    AttentionKind,
    ConfigRewriteWarning,
    EvictionPolicy,
    HiCacheConfig,
    IOBackend,
    MemLayout,
    PrefetchPolicy,
    WritePolicy,
)
from refcache.errors import ConfigError, UnsupportedError

# --- defaults (seed §6) ---------------------------------------------------------------------------------------


def test_defaults_are_the_seeds() -> None:
    c = HiCacheConfig()
    assert c.page_size == 1
    assert c.hicache_write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
    assert c.hicache_io_backend is IOBackend.KERNEL
    assert c.hicache_mem_layout is MemLayout.LAYER_FIRST
    assert c.hicache_storage_prefetch_policy is PrefetchPolicy.BEST_EFFORT
    assert c.radix_eviction_policy is EvictionPolicy.LRU
    assert c.prefetch_threshold == 256
    assert c.prefetch_timeout_base == 1.0
    assert c.prefetch_timeout_per_ki_token == 0.25
    assert c.hicache_storage_backend is None and not c.enable_storage
    assert c.load_back_threshold == 10  # seed §2.3
    assert c.storage_batch_size == 128  # seed §2.2
    assert c.hicache_size == 0.0  # 0: the ratio decides
    assert c.enable_hierarchical_cache and not c.disable_radix_cache


def test_default_config_resolves_without_warnings() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolved = HiCacheConfig().resolve()
    # With the kernel backend and no decode backend given, SGLang picks one silently (seed §5.6).
    assert resolved == dataclasses.replace(HiCacheConfig(), decode_attention_backend="triton")
    assert resolved.resolve() == resolved


def test_timeouts_in_microseconds() -> None:
    c = HiCacheConfig(prefetch_timeout_base=0.001, prefetch_timeout_per_ki_token=0.25)
    assert (c.prefetch_timeout_base_us, c.prefetch_timeout_per_ki_token_us) == (1_000, 250_000)


@pytest.mark.parametrize(
    ("policy", "threshold"), [("write_through", 1), ("write_through_selective", 2), ("write_back", 2)]
)
def test_write_through_threshold(policy: str, threshold: int) -> None:
    """seed §3.5 / D-28: 1 for write_through, 2 otherwise (write_back never counts hits at all)."""
    assert HiCacheConfig(hicache_write_policy=policy).write_through_threshold == threshold  # type: ignore[arg-type]


# --- derived sizes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("device_size", "ratio", "page_size", "host_size"),
    [
        (64, 2.0, 1, 129),  # 128 // 1 + 1 pages
        (64, 2.0, 4, 132),  # an exact multiple still gains a page: (32 + 1) * 4
        (64, 1.5, 4, 100),  # 96 // 4 + 1 = 25 pages
        (10, 2.5, 4, 28),  # 25 // 4 + 1 = 7 pages
        (64, 1.0, 1, 65),  # ratio 1 still leaves one page more than the device
    ],
)
def test_host_size_rounding(device_size: int, ratio: float, page_size: int, host_size: int) -> None:
    c = HiCacheConfig(device_size=device_size, hicache_ratio=ratio, page_size=page_size)
    assert c.host_size == host_size
    assert c.host_size == (int(device_size * ratio) // page_size + 1) * page_size


def test_hicache_size_in_gb_wins_over_ratio() -> None:
    c = HiCacheConfig(hicache_size=0.001, hicache_ratio=100.0, page_size=4)
    assert c.bytes_per_token == 8 * 2 * 2 * 2 * 2  # head_dim * heads * layers * fp16 * (K and V)
    assert c.host_size == (1_000_000 // 128 // 4 + 1) * 4
    mla = HiCacheConfig(hicache_size=0.001, attention=AttentionKind.MLA, dtype="float32")
    assert mla.bytes_per_token == (8 + 4) * 4 * 2  # (kv_lora_rank + qk_rope_head_dim) * fp32 * layers
    assert mla.host_size == 1_000_000 // 96 + 1


@pytest.mark.parametrize(
    ("threshold", "page_size", "effective"), [(256, 1, 256), (2, 4, 4), (0, 64, 64), (300, 64, 300)]
)
def test_effective_prefetch_threshold(threshold: int, page_size: int, effective: int) -> None:
    c = HiCacheConfig(prefetch_threshold=threshold, page_size=page_size, device_size=128)
    assert c.effective_prefetch_threshold == effective == max(threshold, page_size)


@pytest.mark.parametrize(("device_size", "ratio"), [(64, 2.0), (100, 3.0), (7, 1.2)])
def test_prefetch_capacity_limit(device_size: int, ratio: float) -> None:
    c = HiCacheConfig(device_size=device_size, hicache_ratio=ratio)
    assert c.prefetch_capacity_limit == int(0.8 * (c.host_size - c.device_size))
    assert HiCacheConfig().prefetch_capacity_limit == int(0.8 * (129 - 64)) == 52


# --- rejected configurations --------------------------------------------------------------------------------


def test_radix_cache_disabled_is_rejected() -> None:
    with pytest.raises(ConfigError, match="disable_radix_cache"):
        HiCacheConfig(disable_radix_cache=True).resolve()


def test_hierarchical_cache_off_is_rejected() -> None:
    with pytest.raises(ConfigError, match="enable_hierarchical_cache=False"):
        HiCacheConfig(enable_hierarchical_cache=False).resolve()


@pytest.mark.parametrize(
    "config",
    [
        HiCacheConfig(device_size=64, hicache_ratio=0.5),
        HiCacheConfig(device_size=64, hicache_ratio=0.0),
        HiCacheConfig(device_size=1_000_000, hicache_size=0.001),
    ],
    ids=["ratio 0.5", "ratio 0", "small hicache_size"],
)
def test_host_not_larger_than_device_is_rejected(config: HiCacheConfig) -> None:
    """D-20: SGLang's classic assertion, as a ConfigError (0.5.20 only warns)."""
    assert config.host_size <= config.device_size
    with pytest.raises(
        ConfigError, match=f"host capacity {config.host_size} tokens is not larger than device"
    ):
        config.resolve()


@pytest.mark.parametrize(
    ("option", "value", "choices"),
    [
        ("hicache_write_policy", "write_around", "'write_through', 'write_through_selective', 'write_back'"),
        ("hicache_io_backend", "gds", "'kernel', 'direct'"),
        ("hicache_mem_layout", "head_first", "'layer_first', 'page_first', 'page_first_direct', 'page_head'"),
        ("hicache_storage_prefetch_policy", "eager", "'best_effort', 'wait_complete', 'timeout'"),
        ("radix_eviction_policy", "slru", "'lru', 'lfu', 'fifo', 'mru', 'filo', 'priority'"),
        ("attention", "GQA", "'MHA', 'MLA'"),
    ],
)
def test_bad_enum_value_lists_the_choices(option: str, value: str, choices: str) -> None:
    with pytest.raises(ConfigError, match=f"{option}='{value}' is not one of {choices}"):
        HiCacheConfig(**{option: value})  # type: ignore[arg-type]


def test_bad_storage_backend_and_dtype_list_the_choices() -> None:
    with pytest.raises(ConfigError, match="'s3' is not one of file, memory"):
        HiCacheConfig(hicache_storage_backend="s3")
    with pytest.raises(ConfigError, match="dtype='int8' is not one of float16, bfloat16"):
        HiCacheConfig(dtype="int8")


def test_enum_options_accept_strings() -> None:
    c = HiCacheConfig(hicache_write_policy="write_back", attention="MLA")  # type: ignore[arg-type]
    assert c.hicache_write_policy is WritePolicy.WRITE_BACK and c.attention is AttentionKind.MLA


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("page_size", 0),
        ("page_size", -4),
        ("page_size", True),
        ("page_size", 2.0),
        ("tp_size", 0),
        ("device_size", 0),
        ("device_size", -1),
        ("storage_batch_size", 0),
        ("layer_num", 0),
        ("head_num", 0),
        ("head_dim", 0),
    ],
)
def test_non_positive_sizes_are_rejected(option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{option}={value!r} must be a positive integer"):
        HiCacheConfig(**{option: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("option", "value", "what"),
    [
        ("prefetch_threshold", -1, "non-negative integer"),
        ("load_back_threshold", -1, "non-negative integer"),
        ("hicache_ratio", -1.0, "non-negative number"),
        ("hicache_size", -0.5, "non-negative number"),
        ("prefetch_timeout_base", -1.0, "non-negative number"),
        ("prefetch_timeout_per_ki_token", "0.25", "non-negative number"),
    ],
)
def test_negative_values_are_rejected(option: str, value: object, what: str) -> None:
    with pytest.raises(ConfigError, match=what):
        HiCacheConfig(**{option: value})  # type: ignore[arg-type]


def test_page_head_with_mla_is_rejected() -> None:
    config = HiCacheConfig(hicache_mem_layout=MemLayout.PAGE_HEAD, attention=AttentionKind.MLA)
    with pytest.raises(ConfigError, match=r"page_head.*MHA only"):
        config.resolve()
    HiCacheConfig(hicache_mem_layout=MemLayout.PAGE_HEAD).resolve()  # fine for MHA


def test_page_head_with_direct_io_is_rejected() -> None:
    with pytest.raises(ConfigError, match=r"page_head.*kernel"):
        HiCacheConfig(hicache_mem_layout=MemLayout.PAGE_HEAD, hicache_io_backend=IOBackend.DIRECT).resolve()


def test_mla_needs_a_latent_dimension() -> None:
    with pytest.raises(ConfigError, match="MLA needs"):
        HiCacheConfig(attention=AttentionKind.MLA, kv_lora_rank=0, qk_rope_head_dim=0)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("hicache_io_backend", "kernel_ascend"),
        ("hicache_mem_layout", "page_first_kv_split"),
        ("hicache_storage_backend", "mooncake"),
        ("hicache_storage_backend", "hf3fs"),
        ("hicache_storage_backend", "nixl"),
    ],
)
def test_out_of_scope_names_are_unsupported(option: str, value: str) -> None:
    with pytest.raises(UnsupportedError, match=f"{option}='{value}'.*out of scope") as info:
        HiCacheConfig(**{option: value})  # type: ignore[arg-type]
    assert isinstance(info.value, ConfigError)


# --- rewrites (seed §5.3, §5.6) -------------------------------------------------------------------------------


def _resolve_recording(config: HiCacheConfig) -> tuple[HiCacheConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolved = config.resolve()
    assert all(issubclass(w.category, ConfigRewriteWarning) for w in caught)
    return resolved, [str(w.message) for w in caught]


def test_page_first_direct_forces_direct_io() -> None:
    resolved, messages = _resolve_recording(HiCacheConfig(hicache_mem_layout=MemLayout.PAGE_FIRST_DIRECT))
    assert resolved.hicache_io_backend is IOBackend.DIRECT
    assert resolved.hicache_mem_layout is MemLayout.PAGE_FIRST_DIRECT
    assert len(messages) == 1 and messages[0].startswith("hicache_io_backend changed from kernel to direct")


def test_direct_io_turns_page_first_into_page_first_direct() -> None:
    config = HiCacheConfig(hicache_io_backend=IOBackend.DIRECT, hicache_mem_layout=MemLayout.PAGE_FIRST)
    resolved, messages = _resolve_recording(config)
    assert resolved.hicache_mem_layout is MemLayout.PAGE_FIRST_DIRECT
    assert resolved.hicache_io_backend is IOBackend.DIRECT
    assert len(messages) == 1
    assert messages[0].startswith("hicache_mem_layout changed from page_first to page_first_direct")


def test_fa3_decode_with_kernel_io_switches_to_direct() -> None:
    resolved, messages = _resolve_recording(HiCacheConfig(decode_attention_backend="fa3"))
    assert resolved.hicache_io_backend is IOBackend.DIRECT
    assert resolved.decode_attention_backend == "fa3"
    assert len(messages) == 1 and messages[0].startswith("hicache_io_backend changed from kernel to direct")
    assert "FlashAttention3" in messages[0]


def test_fa3_with_page_first_rewrites_both() -> None:
    config = HiCacheConfig(decode_attention_backend="fa3", hicache_mem_layout=MemLayout.PAGE_FIRST)
    resolved, messages = _resolve_recording(config)
    assert (resolved.hicache_io_backend, resolved.hicache_mem_layout) == (
        IOBackend.DIRECT,
        MemLayout.PAGE_FIRST_DIRECT,
    )
    assert [m.split(":")[0] for m in messages] == [
        "hicache_io_backend changed from kernel to direct",
        "hicache_mem_layout changed from page_first to page_first_direct",
    ]


def test_rewrites_are_stable() -> None:
    """Resolving twice changes nothing more and warns no more (passing the chosen values silences it)."""
    resolved, _ = _resolve_recording(HiCacheConfig(hicache_mem_layout=MemLayout.PAGE_FIRST_DIRECT))
    again, messages = _resolve_recording(resolved)
    assert again == resolved and messages == []


def test_kernel_io_picks_a_decode_backend_silently() -> None:
    resolved, messages = _resolve_recording(HiCacheConfig())
    assert resolved.decode_attention_backend == "triton" and messages == []
    resolved, messages = _resolve_recording(HiCacheConfig(hicache_io_backend=IOBackend.DIRECT))
    assert resolved.decode_attention_backend is None and messages == []


# --- JSON codec -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        HiCacheConfig(),
        HiCacheConfig(
            page_size=4,
            hicache_ratio=1.5,
            hicache_write_policy=WritePolicy.WRITE_BACK,
            hicache_storage_backend="file",
            hicache_storage_prefetch_policy=PrefetchPolicy.TIMEOUT,
            radix_eviction_policy=EvictionPolicy.PRIORITY,
            tp_size=4,
            attention=AttentionKind.MLA,
            is_eagle=True,
            model_name="org/model",
            decode_attention_backend="fa3",
        ),
    ],
)
def test_json_round_trip(config: HiCacheConfig) -> None:
    data = config.to_json()
    assert set(data) == {f.name for f in dataclasses.fields(HiCacheConfig)}
    assert all(isinstance(v, bool | int | float | str | type(None)) for v in data.values())
    assert HiCacheConfig.from_json(data) == config
    assert config.dumps() == config.dumps()  # deterministic text


def test_enums_are_written_as_sglang_strings() -> None:
    data = HiCacheConfig().to_json()
    assert data["hicache_write_policy"] == "write_through_selective"
    assert data["hicache_mem_layout"] == "layer_first"
    assert data["attention"] == "MHA"


def test_unknown_keys_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"unknown configuration keys \['hicache_rato'\]"):
        HiCacheConfig.from_json({"hicache_rato": 2.0})


def test_missing_keys_take_defaults() -> None:
    assert HiCacheConfig.from_json({"page_size": 2}) == HiCacheConfig(page_size=2)


@pytest.mark.parametrize(
    "bad",
    [
        {"hicache_ratio": float("nan")},
        {"hicache_size": float("inf")},
        {"model_name": 5},
        {"model_name": ""},
        {"enable_hierarchical_cache": "yes"},
        {"is_eagle": 1},
    ],
)
def test_values_of_the_wrong_type_or_not_finite_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        HiCacheConfig(**bad)  # type: ignore[arg-type]
