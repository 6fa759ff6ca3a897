"""Environment variables the Python package reads: parsed in one place (hostkv_rs._env), and a bad
value is refused naming the variable, the value and what is allowed."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
from hostkv_rs import MHATokenToKVPool, MHATokenToKVPoolHost, _core, _env
from hostkv_rs.pools import memory as _memory
from hostkv_rs.sglang import budgets as _budgets

PACKAGE = pathlib.Path(_env.__file__).parent


def _pool():
    dp = MHATokenToKVPool(16, 4, torch.bfloat16, 1, 8, 2)
    return MHATokenToKVPoolHost(dp, 2.0, 0, 4, "page_first", False)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in _env.VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("value", ["abc", "1e3", "1.0", "-1", "0x1", "1_0", "١", "1024"])
def test_a_bad_numa_node_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("HOSTKV_NUMA_NODE", value)
    text = f"environment variable HOSTKV_NUMA_NODE={value!r}: expected a NUMA node id"
    with pytest.raises(ValueError, match=re.escape(text)):
        _pool()


def test_numa_node_values(monkeypatch):
    assert _env.numa_node() is None
    for value, want in (("", None), ("  ", None), (" 0 ", 0), ("+1", 1), ("1023", 1023)):
        monkeypatch.setenv("HOSTKV_NUMA_NODE", value)
        assert _env.numa_node() == want, value


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("SGLANG_HUGEPAGE_SIZE", "3MB", "'2MB' or '1GB', any case (or unset: base pages)"),
        ("SGLANG_HUGEPAGE_MODE", "sometimes", "one of 'off', 'prefer', 'required', or unset"),
        ("SGLANG_HUGEPAGE_STRICT", "maybe", "one of '1', 'true', '0', 'false' (any case)"),
    ],
)
def test_bad_hugepage_settings_name_the_variable(monkeypatch, name, value, allowed):
    monkeypatch.setenv(name, value)
    text = f"environment variable {name}={value!r}: expected {allowed}"
    with pytest.raises(ValueError, match=re.escape(text)):
        _pool()


def test_a_numa_node_that_does_not_exist_names_the_variable(monkeypatch):
    monkeypatch.setenv("HOSTKV_NUMA_NODE", "1023")  # valid syntax; no host has that node
    with pytest.raises(ValueError, match=r"HOSTKV_NUMA_NODE=1023: NUMA node 1023 does not exist"):
        _pool()


def test_required_hugepages_need_a_size(monkeypatch):
    # Required without a size would silently get base pages.
    monkeypatch.setenv("SGLANG_HUGEPAGE_MODE", "required")
    with pytest.raises(
        ValueError, match="SGLANG_HUGEPAGE_MODE='required': expected SGLANG_HUGEPAGE_SIZE"
    ):
        _env.hugepage_settings()
    monkeypatch.delenv("SGLANG_HUGEPAGE_MODE")
    monkeypatch.setenv("SGLANG_HUGEPAGE_STRICT", "1")
    with pytest.raises(
        ValueError, match="SGLANG_HUGEPAGE_STRICT='1': expected SGLANG_HUGEPAGE_SIZE"
    ):
        _env.hugepage_settings()
    with pytest.raises(ValueError, match="'required' needs a hugepage size"):
        _core.HostRegion(4096, hugepage_mode="required")


def test_hugepage_settings(monkeypatch):
    assert _env.hugepage_settings() == ("", "off")
    for spelling in ("2Mb", " 2mb ", "2m"):  # SGLang upper-cases the value before it reads it
        monkeypatch.setenv("SGLANG_HUGEPAGE_SIZE", spelling)
        assert _env.hugepage_settings() == ("2MB", "prefer"), spelling
    monkeypatch.setenv("SGLANG_HUGEPAGE_SIZE", "1gB")
    assert _env.hugepage_settings() == ("1GB", "prefer")
    monkeypatch.setenv("SGLANG_HUGEPAGE_SIZE", "2M")
    assert _env.hugepage_settings() == ("2MB", "prefer")
    monkeypatch.setenv("SGLANG_HUGEPAGE_STRICT", "TRUE")
    assert _env.hugepage_settings() == ("2MB", "required")
    monkeypatch.setenv("SGLANG_HUGEPAGE_MODE", " Off ")
    assert _env.hugepage_settings() == ("2MB", "off")
    monkeypatch.setenv("SGLANG_HUGEPAGE_MODE", "strict")  # the core's alias
    assert _env.hugepage_settings() == ("2MB", "required")


@pytest.mark.parametrize("value", ["x", "1.5", "1e3", str(2**40)])
def test_a_bad_register_chunk_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB", value)
    text = f"environment variable SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB={value!r}: expected"
    with pytest.raises(ValueError, match=re.escape(text)):
        _memory.register_chunk_limit_bytes()


def test_register_chunk_values(monkeypatch):
    assert _memory.register_chunk_limit_bytes() == 256 * 1024**3
    monkeypatch.setenv("SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB", "-5")  # SGLang: max(gb, 1)
    assert _memory.register_chunk_limit_bytes() == 1024**3
    monkeypatch.setenv("SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB", "8")
    assert _memory.register_chunk_limit_bytes() == 8 * 1024**3


@pytest.mark.parametrize("name", ["SGLANG_NNODES", "NNODES"])
@pytest.mark.parametrize("value", ["two", "0", "-2", "2.0"])
def test_a_bad_node_count_names_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    text = f"environment variable {name}={value!r}: expected a positive decimal integer"
    with pytest.raises(ValueError, match=re.escape(text)):
        _env.nnodes()


def test_a_bad_node_count_is_not_swallowed_by_ranks_per_host(monkeypatch):
    class Dist:
        @staticmethod
        def is_available():
            return True

        @staticmethod
        def is_initialized():
            return True

        @staticmethod
        def get_world_size():
            return 8

    monkeypatch.setattr(torch, "distributed", Dist)
    monkeypatch.setenv("NNODES", "2")
    assert _budgets.ranks_per_host() == 4
    monkeypatch.setenv("SGLANG_NNODES", "4")  # SGLang's name wins
    assert _budgets.ranks_per_host() == 2
    monkeypatch.setenv("SGLANG_NNODES", "four")
    with pytest.raises(ValueError, match="SGLANG_NNODES='four'"):
        _budgets.ranks_per_host()


_READS = re.compile(r"os\.environ\s*\[|os\.environ\.get|os\.getenv|environ\.get\(|getenv\(")


def test_the_package_reads_environment_variables_only_in_env_module():
    # Writes (os.environ.setdefault for a third-party library) are not reads of our settings.
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_env.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _READS.search(line):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert offenders == [], "read these through hostkv_rs._env:\n" + "\n".join(offenders)


def test_every_variable_the_env_module_reads_is_listed():
    source = (PACKAGE / "_env.py").read_text()
    assert set(re.findall(r'"((?:HOSTKV|SGLANG)_[A-Z0-9_]+|NNODES)"', source)) == set(
        _env.VARIABLES
    )


def test_the_sglang_switch(monkeypatch):
    for value, on in (("1", True), ("on", True), ("0", False), ("", False), ("off", False)):
        monkeypatch.setenv("HOSTKV_RS_SGLANG", value)
        assert _env.sglang_switch() is on, value
    monkeypatch.setenv("HOSTKV_RS_SGLANG", "maybe")
    with pytest.raises(ValueError, match="HOSTKV_RS_SGLANG='maybe'"):
        _env.sglang_switch()


def test_the_mooncake_log_switch(monkeypatch):
    for value, read in (
        ("", None),
        (" 0 ", None),
        ("1", "1"),
        ("info", "INFO"),
        ("Trace", "TRACE"),
    ):
        monkeypatch.setenv("HOSTKV_MOONCAKE_LOG", value)
        assert _env.mooncake_log() == read, value
    monkeypatch.delenv("HOSTKV_MOONCAKE_LOG")
    assert _env.mooncake_log() is None
