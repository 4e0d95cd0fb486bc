"""UNIMEM_ALLOC_CONF, in PYTORCH_CUDA_ALLOC_CONF's syntax."""
import pytest

from unimem._runtime.config import parse_alloc_conf

MiB = 1 << 20


def test_defaults():
    s = parse_alloc_conf(None)
    assert s.max_split_size is None and s.roundup_power2_divisions == [0] * 16
    assert s.garbage_collection_threshold == 0.0 and s.per_process_memory_fraction is None


def test_all_options():
    s = parse_alloc_conf("max_split_size_mb:128, garbage_collection_threshold:0.6,"
                         "roundup_power2_divisions:4,per_process_memory_fraction:0.5,"
                         "max_non_split_rounding_mb:40,expandable_segments:False,backend:native")
    assert s.max_split_size == 128 * MiB
    assert s.garbage_collection_threshold == 0.6
    assert s.roundup_power2_divisions == [4] * 16
    assert s.per_process_memory_fraction == 0.5
    assert s.max_non_split_rounding == 40 * MiB
    assert s.expandable_segments is False and s.core_kwargs()["expandable_segments"] is False


def test_expandable_segments_reach_the_core():
    s = parse_alloc_conf("expandable_segments:True")
    assert s.expandable_segments is True
    assert s.core_kwargs()["expandable_segments"] is True
    assert parse_alloc_conf(None).core_kwargs()["expandable_segments"] is False


def test_roundup_list_form_as_pytorch():
    s = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    # intervals: index 8 = 256 MiB, 9 = 512 MiB, 10 = 1 GiB; below the first: its value
    assert s.roundup_power2_divisions == [1] * 9 + [2, 4] + [8] * 5
    s = parse_alloc_conf("roundup_power2_divisions:[1:4,2:0]")
    assert s.roundup_power2_divisions[:2] == [4, 0] and s.roundup_power2_divisions[2:] == [0] * 14


@pytest.mark.parametrize("text, message", [
    ("max_split_size_mb:10", "too small"),
    ("max_split_size_mb:abc", "non-negative integer"),
    ("max_split_size_mb", "unexpected end"),
    ("max_split_size_mb:100,", "trailing"),
    ("garbage_collection_threshold:1.5", r"\(0.0, 1.0\)"),
    ("garbage_collection_threshold:nan", "NaN"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("roundup_power2_divisions:[256:3]", "power of 2"),
    ("roundup_power2_divisions:[300:2]", "intervals"),
    ("roundup_power2_divisions:[256:2", "missing ']'"),
    ("per_process_memory_fraction:2", r"\[0.0, 1.0\]"),
    ("expandable_segments:yes", "True or False"),
    ("backend:cudaMallocAsync", "not supported"),
    ("max_split_size_mb:100,max_split_size_mb:200", "twice"),
    ("max_spilt_size_mb:100", "unrecognized option 'max_spilt_size_mb'"),
    ("max_split_size_mb=100", "unrecognized option"),
])
def test_malformed_options_are_value_errors(text, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_alloc_conf(text)
    assert "UNIMEM_ALLOC_CONF" in str(info.value)


@pytest.mark.parametrize("text, hint", [
    ("max_split_size_mb=256", "'max_split_size_mb:256'"),
    (" max_split_size_mb = 256 ", "'max_split_size_mb:256'"),             # spaces vanish, as PyTorch's
    ("max_split_size_mb:100,garbage_collection_threshold=0.6", "'garbage_collection_threshold:0.6'"),
    ("roundup_power2_divisions=[256:1,>:8],expandable_segments:True", "'roundup_power2_divisions:[256:1,>:8]'"),
    ("roundup_power2_divisions=[256:1", "'roundup_power2_divisions:[256:1'"),
    ("expandable_segments=True", "'expandable_segments:True'"),
    ("pinned_use_cuda_host_register=True", "'pinned_use_cuda_host_register:True'"),   # an inert option too
])
def test_key_equals_value_is_a_value_error_with_the_key_colon_value_hint(text, hint):
    """``key=value`` (not PyTorch's ``key:value``) names the spelling meant."""
    with pytest.raises(ValueError, match="unrecognized option") as info:
        parse_alloc_conf(text)
    assert f"did you mean {hint}?" in str(info.value)
    assert "UNIMEM_ALLOC_CONF" in str(info.value)


@pytest.mark.parametrize("text", ["max_spilt_size_mb=256", "=256", "max_split_size_mb256"])
def test_no_key_colon_value_hint_for_an_unknown_option(text):
    with pytest.raises(ValueError, match="unrecognized option") as info:
        parse_alloc_conf(text)
    assert "did you mean" not in str(info.value)


def test_max_reserved_ratio():
    assert parse_alloc_conf("max_reserved_ratio:1.1").max_reserved_ratio == 1.1
    assert parse_alloc_conf("").max_reserved_ratio is None
    assert parse_alloc_conf("").core_kwargs()["max_reserved_ratio"] == 0.0
    with pytest.raises(ValueError, match="at least 1.0, or 0 to turn it off"):
        parse_alloc_conf("max_reserved_ratio:0.5")


@pytest.mark.parametrize("text, ratio", [
    ("expandable_segments:True", 1.09),                          # the default bound
    ("expandable_segments:True,max_reserved_ratio:1.5", 1.5),
    ("expandable_segments:True,max_reserved_ratio:0", 0.0),      # off: PyTorch's expandable segments
    ("max_reserved_ratio:0,expandable_segments:True", 0.0),
    ("max_reserved_ratio:0", 0.0),
])
def test_max_reserved_ratio_0_turns_the_expandable_bound_off(text, ratio):
    """The bound expandable segments bring by default is turned off with 0
    (it could not be: 0 was refused, and inf too)."""
    assert parse_alloc_conf(text).core_kwargs()["max_reserved_ratio"] == ratio


# ---------------------------------------------------------------------------
# sizes that do not fit, digits that are not ASCII
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("text, option", [
    ("max_split_size_mb:17592186044416", "max_split_size_mb"),       # 2**44 MiB: overflows a size_t
    ("max_non_split_rounding_mb:17592186044416", "max_non_split_rounding_mb"),
    ("max_split_size_mb:99999999999999999999999", "max_split_size_mb"),
    ("roundup_power2_divisions:18446744073709551616", "roundup_power2_divisions"),   # 2**64
    ("roundup_power2_divisions:[18446744073709551616:2]", "interval"),
    ("max_split_size_mb:\u0663\u0660", "max_split_size_mb"),    # ARABIC-INDIC 30: int() takes it
    ("max_split_size_mb:2\u00b2", "max_split_size_mb"),          # SUPERSCRIPT TWO: isdigit() takes it
    ("roundup_power2_divisions:\u0664", "roundup_power2_divisions"),
    ("roundup_power2_divisions:[\u0662\u0665\u0666:2]", "interval"),
    ("garbage_collection_threshold:\u0660.\u0665", "garbage_collection_threshold"),   # float() takes it
    ("per_process_memory_fraction:\u0660.\u0665", "per_process_memory_fraction"),
    ("per_process_memory_fraction:0x1p-1", "per_process_memory_fraction"),
    ("per_process_memory_fraction:0.5.5", "per_process_memory_fraction"),
    ("per_process_memory_fraction:inf", "per_process_memory_fraction"),
    ("per_process_memory_fraction:1_0", "per_process_memory_fraction"),
    ("max_reserved_ratio:inf", "max_reserved_ratio"),
    ("max_reserved_ratio:1e999", "max_reserved_ratio"),
])
def test_oversized_or_non_ascii_values_are_value_errors_naming_the_option(text, option):
    with pytest.raises(ValueError, match=option) as info:
        parse_alloc_conf(text)
    assert "UNIMEM_ALLOC_CONF" in str(info.value)


def test_the_largest_sizes_accepted_fit_the_core():
    from unimem import _core
    from unimem._runtime import config as _config
    assert _config.MAX_SIZE_BYTES == _core.MAX_REQUEST_SIZE
    with pytest.raises(ValueError, match="max_split_size_mb is too large"):
        parse_alloc_conf(f"max_split_size_mb:{_config.MAX_SIZE_MB + 1}")
    s = parse_alloc_conf(f"max_split_size_mb:{_config.MAX_SIZE_MB},max_non_split_rounding_mb:{_config.MAX_SIZE_MB}")
    assert s.max_split_size == _core.MAX_REQUEST_SIZE
    from unimem.backends.simulated import SimulatedBackend
    allocator = _core.CachingAllocator(SimulatedBackend(capacity=1 << 30), 0, **s.core_kwargs())
    allocator.free(allocator.malloc(100 * MiB))       # the core takes them and works
    s = parse_alloc_conf("roundup_power2_divisions:9223372036854775808")      # 2**63, fits a size_t
    _core.CachingAllocator(SimulatedBackend(capacity=1 << 30), 0, **s.core_kwargs())


def test_decimal_numbers_in_ascii_forms():
    assert parse_alloc_conf("garbage_collection_threshold:.5").garbage_collection_threshold == 0.5
    assert parse_alloc_conf("garbage_collection_threshold:5e-1").garbage_collection_threshold == 0.5
    assert parse_alloc_conf("per_process_memory_fraction:1.").per_process_memory_fraction == 1.0
    assert parse_alloc_conf("per_process_memory_fraction:+0.25").per_process_memory_fraction == 0.25


def test_a_malformed_fraction_fails_when_the_environment_is_read(monkeypatch):
    from unimem._runtime.config import settings_from_env
    monkeypatch.setenv("UNIMEM_ALLOC_CONF", "per_process_memory_fraction:\u0660.\u0665")
    with pytest.raises(ValueError, match="per_process_memory_fraction"):
        settings_from_env()


# ---------------------------------------------------------------------------
# every option of PYTORCH_CUDA_ALLOC_CONF, checked as PyTorch does
# ---------------------------------------------------------------------------
PYTORCH_OPTIONS_ALL_AT_ONCE = (
    "backend:native, max_split_size_mb:64, max_non_split_rounding_mb:40,"
    "garbage_collection_threshold:0.5, roundup_power2_divisions:[64:8,256:4,1024:4,>:1],"
    "expandable_segments:False, large_segment_size_mb:20,"
    "release_lock_on_cudamalloc:True, pinned_use_cuda_host_register:True,"
    "pinned_num_register_threads:8, pinned_reserve_segment_size_mb:64,"
    "pinned_use_background_threads:True, graph_capture_record_stream_reuse:False")


def test_every_pytorch_option_is_accepted():
    s = parse_alloc_conf(PYTORCH_OPTIONS_ALL_AT_ONCE)
    assert s.max_split_size == 64 * MiB and s.garbage_collection_threshold == 0.5
    assert s.inert_options == {
        "release_lock_on_cudamalloc": True, "pinned_use_cuda_host_register": True,
        "pinned_num_register_threads": 8, "pinned_reserve_segment_size_mb": 64,
        "pinned_use_background_threads": True, "graph_capture_record_stream_reuse": False}
    s = parse_alloc_conf("release_lock_on_hipmalloc:False,pinned_use_hip_host_register:False")
    assert s.inert_options == {"release_lock_on_hipmalloc": False, "pinned_use_hip_host_register": False}


def test_pytorch_2_13s_newer_options_are_accepted():
    """PyTorch 2.13's pinned_max_*_mb (AllocatorConfig) and the CUDA keys
    pinned_free_catch_all and throw_on_cudamalloc_oom were refused as
    unrecognized; they are accepted, checked, and inert."""
    s = parse_alloc_conf("pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:0,"
                         "pinned_free_catch_all:True,throw_on_cudamalloc_oom:False")
    assert s.inert_options == {"pinned_max_round_threshold_mb": 64, "pinned_max_cached_size_mb": 0,
                               "pinned_free_catch_all": True, "throw_on_cudamalloc_oom": False}
    assert s.core_kwargs() == parse_alloc_conf("").core_kwargs()
    for bad in ("pinned_max_cached_size_mb:abc", "pinned_max_round_threshold_mb:-1",
                "pinned_free_catch_all:yes", "throw_on_cudamalloc_oom:1"):
        with pytest.raises(ValueError):
            parse_alloc_conf(bad)


def test_each_inert_option_is_listed_with_a_reason():
    from unimem._runtime import config as _config
    for name, reason in _config.INERT_OPTIONS:
        assert name in _config.SUPPORTED_KEYS and len(reason) > 20
    assert {name for name, _ in _config.INERT_OPTIONS} >= {
        "release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
        "pinned_reserve_segment_size_mb", "pinned_use_background_threads", "graph_capture_record_stream_reuse"}


@pytest.mark.parametrize("text, message", [
    ("expandable_segments:true", "True or False"),            # PyTorch takes only True/False
    ("expandable_segments:1", "True or False"),
    ("backend:cudaMallocAsync", "not supported yet"),
    ("backend:jemalloc", "unknown allocator backend"),
    ("large_segment_size_mb:10", "> 10"),
    ("large_segment_size_mb:64", "not supported yet"),
    ("release_lock_on_cudamalloc:yes", "release_lock_on_cudamalloc must be True or False"),
    ("pinned_use_cuda_host_register:1", "pinned_use_cuda_host_register must be True or False"),
    ("pinned_use_background_threads:on", "pinned_use_background_threads must be True or False"),
    ("graph_capture_record_stream_reuse:false", "graph_capture_record_stream_reuse must be True or False"),
    ("pinned_num_register_threads:3", "power of 2"),
    ("pinned_num_register_threads:0", "power of 2"),
    ("pinned_num_register_threads:256", "at most 128"),
    ("pinned_reserve_segment_size_mb:0", "greater than 0"),
    ("pinned_reserve_segment_size_mb:\u0661", "ASCII"),
    ("expandable_segments:False,expandable_segments:False", "twice"),
])
def test_pytorch_options_are_validated_as_pytorch_does(text, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_alloc_conf(text)
    assert "UNIMEM_ALLOC_CONF" in str(info.value)


# ---------------------------------------------------------------------------
# PyTorch's wording for an out-of-range memory fraction
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["2", "1.0001", "-0.5", "-1"])
def test_an_out_of_range_memory_fraction_is_refused_in_pytorchs_words(value):
    """c10/cuda/CUDAAllocatorConfig.cpp, parsePerProcessMemoryFraction:
    "per_process_memory_fraction is invalid, set it in [0.0, 1.0]"."""
    with pytest.raises(ValueError) as info:
        parse_alloc_conf(f"per_process_memory_fraction:{value}")
    assert str(info.value).endswith("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
    assert str(info.value).startswith("UNIMEM_ALLOC_CONF=")
