"""UNIMEM_ALLOC_CONF, in PYTORCH_CUDA_ALLOC_CONF's syntax."""
import pytest

from unimem._config import parse_alloc_conf

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
    ("expandable_segments:True", "not supported"),
    ("backend:cudaMallocAsync", "not supported"),
    ("max_split_size_mb:100,max_split_size_mb:200", "twice"),
    ("max_spilt_size_mb:100", "unrecognized option 'max_spilt_size_mb'"),
    ("max_split_size_mb=100", "unrecognized option"),
])
def test_malformed_options_are_value_errors(text, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_alloc_conf(text)
    assert "UNIMEM_ALLOC_CONF" in str(info.value)


def test_max_reserved_ratio():
    assert parse_alloc_conf("max_reserved_ratio:1.1").max_reserved_ratio == 1.1
    assert parse_alloc_conf("").max_reserved_ratio == 0.0
    with pytest.raises(ValueError, match="at least 1.0"):
        parse_alloc_conf("max_reserved_ratio:0.5")
