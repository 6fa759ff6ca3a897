"""Tests against a REAL SGLang release: run by scripts/test_sglang.sh in a venv per release.

Without SGLang (the main suite's interpreter), nothing here is imported: every test module in
this directory is left out of collection and one placeholder reports the directory as skipped,
with the reason. Note that `import sglang` alone proves nothing there: `tests/` is on sys.path,
so this very directory would import as an empty namespace package named `sglang`; the check is
the installed distribution's metadata, and `_NoNamespaceSglang` keeps that accidental namespace
package from ever being imported in the main suite.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import sys
import warnings
from pathlib import Path

import pytest


def _why_not_sglang() -> str | None:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return (
            "SGLang is not installed in this interpreter; these tests run against real SGLang "
            "releases through scripts/test_sglang.sh (one venv per release)"
        )
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return f"sglang {version} is installed but `import sglang` does not resolve to it"
    return None


def pytest_configure(config):
    # The suite runs with filterwarnings = error (pyproject.toml); what SGLang itself warns about
    # while importing on a CPU machine (AWQ/GGUF need a GPU, ...) is SGLang's business, and so is
    # the SWIG DeprecationWarning Mooncake's bindings raise when imported.
    for line in (
        "ignore::UserWarning:sglang.*",
        "ignore::DeprecationWarning:sglang.*",
        "ignore::FutureWarning:sglang.*",
        "ignore:builtin type swig:DeprecationWarning",
    ):
        config.addinivalue_line("filterwarnings", line)


def pytest_unconfigure(config):
    # Mooncake's SWIG bindings warn (DeprecationWarning) while the interpreter finalizes, from a
    # capsule destructor that cannot handle the exception the suite's "error" filter would turn
    # that warning into (a segfault at exit); leave the interpreter with quiet defaults.
    warnings.resetwarnings()
    warnings.simplefilter("ignore", DeprecationWarning)


SKIP_REASON = _why_not_sglang()
_HERE = Path(__file__).parent

if SKIP_REASON is not None:
    collect_ignore_glob = ["test_*.py", "sgl_*.py", "*_script.py"]

    class _NoNamespaceSglang:
        """Without SGLang, `import sglang` would succeed as an empty namespace package made of
        this directory (tests/ is on sys.path) and stay in sys.modules, shadowing stand-in
        packages later tests put on sys.path (tests/test_sglang_install.py). Make exactly that
        case the ModuleNotFoundError of a machine without SGLang; any real or stand-in `sglang`
        package imports as usual."""

        def find_spec(self, name, path=None, target=None):
            if name != "sglang":
                return
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is None:
                locations = {Path(p).resolve() for p in spec.submodule_search_locations or ()}
                if locations <= {_HERE.resolve()}:
                    raise ModuleNotFoundError("No module named 'sglang'", name="sglang")

    if not any(type(f).__name__ == "_NoNamespaceSglang" for f in sys.meta_path):
        sys.meta_path.insert(0, _NoNamespaceSglang())

    class _SkippedDirectory(pytest.Item):
        def runtest(self):
            pytest.skip(SKIP_REASON)

        def reportinfo(self):
            return self.path, None, "tests/sglang"

    class _Placeholder(pytest.File):
        def collect(self):
            yield _SkippedDirectory.from_parent(self, name="requires_sglang")

    def pytest_collect_file(file_path, parent):
        if file_path == _HERE / "conftest.py":
            return _Placeholder.from_parent(parent, path=file_path)
        return None

else:
    with warnings.catch_warnings():
        # SGLang warns while importing on a CPU machine (AWQ/GGUF need a GPU): its business.
        for category in (UserWarning, DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module="sglang")
        # Mooncake's SWIG bindings (imported by SGLang's storage backends) warn while their
        # module initialises; turned into an error there, they leave a half-built module that
        # crashes the interpreter at exit.
        warnings.filterwarnings("ignore", message="builtin type swig", category=DeprecationWarning)
        import sgl_harness as H

    def pytest_report_header(config):
        return f"sglang {H.SGLANG_VERSION} (release {'.'.join(map(str, H.REL))})"

    def pytest_terminal_summary(terminalreporter):
        if H.REPORT:
            terminalreporter.section(f"derived from SGLang {H.SGLANG_VERSION}")
            for line in dict.fromkeys(H.REPORT):  # de-duplicated, in order
                terminalreporter.write_line(line)

    @pytest.fixture(scope="session")
    def rel():
        """The installed SGLang release as a tuple, e.g. (0, 5, 23)."""
        return H.REL

    @pytest.fixture(scope="session", autouse=True)
    def _cpu_shims():
        with H.cpu_shims():
            yield

    @pytest.fixture(autouse=True)
    def _isolation():
        """Each test starts with fixed seeds, no published ServerArgs and hostkv_rs not installed,
        and leaves it that way (a test that forgets to uninstall must not leak patches)."""
        torch_seed()
        yield
        H.rc.reset_context()
        shim = _loaded_shim()
        if shim is not None and shim.installed():
            shim.uninstall()

    def torch_seed():
        import random

        import torch

        random.seed(0)
        torch.manual_seed(0)

    def _loaded_shim():
        import sys

        return sys.modules.get("hostkv_rs.sglang")

    @pytest.fixture
    def gen():
        import torch

        g = torch.Generator()
        g.manual_seed(1234)
        return g

    @pytest.fixture
    def publish():
        """publish(**server_args_overrides): a fresh ServerArgs in SGLang's runtime context for
        this test (reset afterwards)."""
        return H.publish

    @pytest.fixture
    def sglang_alloc():
        """SGLang's own host pools allocate plain CPU tensors while this is active."""
        with H.sglang_cpu_alloc():
            yield

    @pytest.fixture
    def hk():
        """The hostkv_rs package under test (installed wheel, or PYTHONPATH=python)."""
        import hostkv_rs

        return hostkv_rs

    @pytest.fixture
    def installed(hk):
        """hostkv_rs.sglang.install() for the test, uninstall() afterwards."""
        import hostkv_rs.sglang as shim

        patched = shim.install()
        assert shim.installed(), "install() returned but installed() is False"
        yield patched
        shim.uninstall()
        assert not shim.installed(), "uninstall() returned but installed() is still True"

    @pytest.fixture
    def hk_log(caplog):
        """Captures hostkv_rs's log records (INFO and up)."""
        caplog.set_level(logging.INFO, logger="hostkv_rs")
        return caplog
