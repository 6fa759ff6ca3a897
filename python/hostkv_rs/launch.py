"""Make an unmodified SGLang server build hostkv_rs pools in every process it starts.

`python -m sglang.launch_server` starts its schedulers in spawned interpreters, so calling
`hostkv_rs.sglang.install()` in the launching process is not enough. `hostkv-rs launch-sglang --
<sglang args>` (or the environment `launch_env()` returns) puts `_boot/` first on PYTHONPATH and
sets `HOSTKV_RS_SGLANG=1`; every interpreter started with that environment, spawned children
included, then runs `_boot/sitecustomize.py`, which calls `arm()`: the first `import sglang` of
the process is followed by `install()` and one log line saying which pools hostkv_rs serves in
that process. Without the switch nothing of SGLang is touched.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

SWITCH = "HOSTKV_RS_SGLANG"
BOOT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot")


def launch_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the switch on and `_boot/` first on
    PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env[SWITCH] = "1"
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != BOOT_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, *rest])
    return env


def switched_on() -> bool:
    from hostkv_rs import _env

    return _env.sglang_switch()


def _say(message: str) -> None:
    # stderr, not logging: this runs before SGLang configures its loggers, and the server log
    # is where a user looks for it.
    print(f"hostkv_rs[{os.getpid()}]: {message}", file=sys.stderr, flush=True)


def serve() -> None:
    """Install hostkv_rs into the SGLang this process imported, and say so once."""
    try:
        import hostkv_rs.sglang as shim

        patched = shim.install()
        release = shim.release()
    except Exception as exc:  # noqa: BLE001 - the server must still start, with SGLang's pools
        _say(f"not serving SGLang host pools ({type(exc).__name__}: {exc}); SGLang's own run")
        return
    classes = sorted({name.rsplit(".", 1)[-1] for names in patched.values() for name in names})
    shown = ", ".join(classes) if classes else "no pool classes found"
    version = getattr(release, "version", release)
    _say(f"serving SGLang {version} HiCache host pools: {shown}")


class _AfterSglang(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it asks the finders after it where `sglang` is (sys.path, or the
    finder of an editable install) and runs `serve()` right after the package's `__init__` has
    executed. It stays armed until then: a `find_spec("sglang")` probe before the import gets a
    spec that is never executed, and must not disarm it."""

    served = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "sglang" or self.served:
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        run_init = loader.exec_module

        def exec_module(module):
            run_init(module)
            if not self.served:
                self.served = True
                if self in sys.meta_path:
                    sys.meta_path.remove(self)
                serve()

        loader.exec_module = exec_module
        return spec


def arm() -> None:
    """Serve at this process's first `import sglang` (now, if it already happened)."""
    if "sglang" in sys.modules:
        serve()
    elif not any(isinstance(f, _AfterSglang) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterSglang())
