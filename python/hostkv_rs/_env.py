"""Every environment variable the Python package reads, parsed here and nowhere else: a bad value
is refused with a ValueError that names the variable, the value and what is allowed, instead of
surfacing as a bare `int()` error deep inside a pool constructor.

A variable set to an empty (or all-blank) string counts as unset, as SGLang's `os.environ.get(...)
or default` reads do. Variables read only by the Rust core (`HOSTKV_CPU_ENGINE`,
`HOSTKV_UNREGISTER_TIMEOUT_S`, `HOSTKV_REGISTER_PARALLEL_BYTES`, `HOSTKV_LOG_REGISTER`,
`HOSTKV_DIRECT_BATCH`, `HOSTKV_BLOCK_QUOTA`, `HOSTKV_TENSOR_EXTENT`) are parsed there.
"""

from __future__ import annotations

import os
import re

# What each variable means, for error messages and the docs; tests check that the package reads
# no other variable.
VARIABLES = {
    "HOSTKV_NUMA_NODE": "NUMA node that host pool memory is bound to (mbind)",
    "SGLANG_HUGEPAGE_SIZE": "hugepage size of host pool memory",
    "SGLANG_HUGEPAGE_MODE": "whether hugepages are preferred or required",
    "SGLANG_HUGEPAGE_STRICT": "older spelling of SGLANG_HUGEPAGE_MODE=required",
    "SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB": "largest single cudaHostRegister call, in GiB",
    "SGLANG_NNODES": "nodes of the job (host memory is split over the ranks of one node)",
    "NNODES": "nodes of the job, when SGLANG_NNODES is unset",
    "HOSTKV_RS_SGLANG": "serve SGLang's host pools in every process (hostkv_rs.launch)",
    "HOSTKV_PAGE_DIGEST": "debug check: a load refuses a host page changed since its backup",
    "HOSTKV_MOONCAKE_LOG": "Mooncake's own logging (hostkv_rs.l3): on, or at the level named",
}

# Linux numbers NUMA nodes below MAX_NUMNODES (at most 1 << 10).
_MAX_NUMA_NODES = 1 << 10
# A chunk of this many GiB already exceeds any host's memory; larger values cannot be meant and
# would not fit the core's 64-bit byte count.
_MAX_CHUNK_GB = 1 << 30
_INTEGER = re.compile(r"[+-]?[0-9]+")
# The spellings accepted (upper-cased first, as SGLang's mmap allocator reads the variable), each
# mapped to SGLang's.
_HUGEPAGE_SIZES = {"2MB": "2MB", "2M": "2MB", "1GB": "1GB", "1G": "1GB"}
# "strict" is the core's alias of "required" (SGLANG_HUGEPAGE_STRICT's word).
_HUGEPAGE_MODES = {"off": "off", "prefer": "prefer", "required": "required", "strict": "required"}
_TRUE, _FALSE = ("1", "true"), ("0", "false")


def raw(name: str) -> str | None:
    """The stripped value of `name`, or None when it is unset or blank."""
    value = os.environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _refuse(name: str, value: str, allowed: str) -> ValueError:
    return ValueError(f"environment variable {name}={value!r}: expected {allowed}")


def integer(name: str, default: int | None, *, low: int, high: int, allowed: str) -> int | None:
    """`name` as a decimal integer in `[low, high]`, or `default` when unset. `int()` alone would
    take '1_000' and non-ASCII digits, and turn '1e3' into a message without the variable."""
    value = raw(name)
    if value is None:
        return default
    if not _INTEGER.fullmatch(value):
        raise _refuse(name, value, allowed)
    number = int(value)
    if not low <= number <= high:
        raise _refuse(name, value, allowed)
    return number


def flag(name: str) -> bool:
    """SGLang's boolean reading ('1'/'true' on, '0'/'false' off, any case); any other value is
    refused rather than silently read as off."""
    value = raw(name)
    if value is None:
        return False
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise _refuse(name, value, "one of '1', 'true', '0', 'false' (any case), or unset")


# ---- the variables ------------------------------------------------------------------------------


def numa_node() -> int | None:
    return integer(
        "HOSTKV_NUMA_NODE",
        None,
        low=0,
        high=_MAX_NUMA_NODES - 1,
        allowed=f"a NUMA node id, a decimal integer in [0, {_MAX_NUMA_NODES}), or unset",
    )


def hugepage_settings() -> tuple[str, str]:
    """(size, mode): size '' / '2MB' / '1GB'; mode 'off' / 'prefer' / 'required'. Without a
    mode, SGLANG_HUGEPAGE_STRICT picks 'required', else a size alone means 'prefer'."""
    size_value = raw("SGLANG_HUGEPAGE_SIZE")
    size = ""
    if size_value is not None:
        size = _HUGEPAGE_SIZES.get(size_value.upper(), "")
        if not size:
            raise _refuse(
                "SGLANG_HUGEPAGE_SIZE",
                size_value,
                "'2MB' or '1GB', any case (or unset: base pages)",
            )
    mode_value = raw("SGLANG_HUGEPAGE_MODE")
    if mode_value is not None:
        mode = mode_value.lower()
        if mode not in _HUGEPAGE_MODES:
            raise _refuse(
                "SGLANG_HUGEPAGE_MODE", mode_value, "one of 'off', 'prefer', 'required', or unset"
            )
        mode = _HUGEPAGE_MODES[mode]
        if mode == "required" and not size:
            raise _refuse(
                "SGLANG_HUGEPAGE_MODE", mode_value, "SGLANG_HUGEPAGE_SIZE ('2MB' or '1GB') set too"
            )
        return size, mode
    if flag("SGLANG_HUGEPAGE_STRICT"):
        if not size:
            raise _refuse(
                "SGLANG_HUGEPAGE_STRICT",
                raw("SGLANG_HUGEPAGE_STRICT") or "",
                "SGLANG_HUGEPAGE_SIZE set too",
            )
        return size, "required"
    return size, "prefer" if size else "off"


def register_chunk_gb(default: int) -> int:
    """SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB; SGLang reads values below 1 as 1."""
    gb = integer(
        "SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB",
        default,
        low=-(2**63),
        high=_MAX_CHUNK_GB,
        allowed=f"a decimal integer number of GiB, at most {_MAX_CHUNK_GB} (below 1 means 1)",
    )
    return max(gb, 1)


def nnodes() -> int:
    """SGLANG_NNODES, else NNODES, else 1."""
    for name in ("SGLANG_NNODES", "NNODES"):
        value = integer(
            name, None, low=1, high=2**31 - 1, allowed="a positive decimal integer, or unset"
        )
        if value is not None:
            return value
    return 1


def sglang_switch() -> bool:
    """HOSTKV_RS_SGLANG: whether hostkv_rs.launch's start-up hook installs hostkv_rs into SGLang."""
    value = raw("HOSTKV_RS_SGLANG")
    if value is None or value.lower() in ("0", "false", "no", "off"):
        return False
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    raise _refuse("HOSTKV_RS_SGLANG", value, "one of 1, true, yes, on, 0, false, no, off, or unset")


def page_digest() -> bool:
    """HOSTKV_PAGE_DIGEST: backups digest the host pages they write and loads verify them (a
    debugging aid for silent host-memory corruption; off by default)."""
    return flag("HOSTKV_PAGE_DIGEST")


def mooncake_log() -> str | None:
    """HOSTKV_MOONCAKE_LOG: None while Mooncake's own logging stays quiet (unset, blank or 0),
    else the value upper-cased. TRACE, INFO, WARNING or ERROR also pick Mooncake's level; any
    other value (1, yes, ...) turns its logging on at its default level, so nothing is refused."""
    value = raw("HOSTKV_MOONCAKE_LOG")
    if value is None or value == "0":
        return None
    return value.upper()
