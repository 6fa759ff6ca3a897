"""`hostkv-rs launch-sglang` / `hostkv_rs.launch`: an unmodified SGLang server builds hostkv_rs
pools in every process it starts, including the spawned interpreters its schedulers run in, and
with the switch off nothing of SGLang is touched. Each case runs in fresh interpreters, started
the way SGLang starts its schedulers (multiprocessing's spawn context)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hostkv_rs.launch import launch_env

HERE = Path(__file__).parent

SERVER = r'''
import json, multiprocessing as mp, os, sys

def scheduler(q):
    """What a scheduler process does first: build the KV host pool through SGLang's site."""
    out = {"pid": os.getpid()}
    try:
        os.environ["HOSTKV_SGLANG_INSTALL_FIRST"] = "1"  # the harness may find ours installed
        import sgl_harness as H
        dev = H.mha_device()
        H.publish(page_size=dev.page_size, hicache_mem_layout="page_first")
        with H.sglang_cpu_alloc():
            pool = H.build_kv_host_pool(kv_pool=dev, page_size=dev.page_size, use_mla=False)
        out["module"] = type(pool).__module__
        out["installed"] = __import__("hostkv_rs.sglang").sglang.installed()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    q.put(out)

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=scheduler, args=(q,))
    p.start()
    result = q.get(timeout=240)
    p.join(60)
    result["parent_imported_sglang"] = "sglang" in sys.modules
    print("RESULT " + json.dumps(result))
'''


def _run(tmp_path, env):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join([p for p in [env.get("PYTHONPATH", ""), str(HERE)] if p])
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=str(HERE.parent),
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT ") :]), proc.stderr


def test_spawned_scheduler_builds_hostkv_rs_pools(tmp_path):
    result, stderr = _run(tmp_path, launch_env())
    assert "error" not in result, result
    assert result["module"].startswith("hostkv_rs"), result
    assert result["installed"] is True
    # One line, from the process that imported SGLang (the scheduler), naming what is served.
    served = [line for line in stderr.splitlines() if "serving SGLang" in line]
    assert served == [line for line in served if line.startswith(f"hostkv_rs[{result['pid']}]")]
    assert len(served) == 1 and "MHATokenToKVPoolHost" in served[0], stderr
    assert result["parent_imported_sglang"] is False


def test_without_the_switch_sglang_is_untouched(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HOSTKV_RS_SGLANG"}
    result, stderr = _run(tmp_path, env)
    assert "error" not in result, result
    assert result["module"].startswith("sglang."), result
    assert result["installed"] is False
    assert "hostkv_rs[" not in stderr
    # The hook directory alone (switch off) arms nothing either.
    env = launch_env(env)
    env["HOSTKV_RS_SGLANG"] = "0"
    result, stderr = _run(tmp_path, env)
    assert result["module"].startswith("sglang."), result
    assert "hostkv_rs[" not in stderr


def test_launch_sglang_command_runs_sglangs_launcher_with_the_hook():
    proc = subprocess.run(
        [sys.executable, "-m", "hostkv_rs", "launch-sglang", "--", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr:
        pytest.skip(
            "sglang.launch_server --help needs packages this test venv leaves out: "
            + proc.stderr.strip().splitlines()[-1]
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage" in proc.stdout.lower()
    assert "serving SGLang" in proc.stderr, proc.stderr[-3000:]


def _hooked(tmp_path, code: str, extra_path: str = "") -> subprocess.CompletedProcess:
    script = tmp_path / "probe.py"
    script.write_text(code)
    env = launch_env()
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], extra_path])
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=str(tmp_path),
        check=False,
    )


def _assert_served_once(proc: subprocess.CompletedProcess) -> None:
    """The probe ran to its end with ours installed, and the hook said so in one line."""
    assert proc.returncode == 0, proc.stderr
    assert "installed True" in proc.stdout, proc.stdout + proc.stderr
    assert len([line for line in proc.stderr.splitlines() if "serving SGLang" in line]) == 1


def test_a_find_spec_probe_before_the_import_leaves_the_hook_armed(tmp_path):
    # Availability checks (`importlib.util.find_spec("sglang")`) run before the real import in
    # many launchers; the spec they get is never executed.
    proc = _hooked(
        tmp_path,
        "import importlib.util, hostkv_rs.sglang as s\n"
        "assert importlib.util.find_spec('sglang') is not None\n"
        "assert not s.installed()\n"
        "import sglang\n"
        "print('installed', s.installed())\n",
    )
    _assert_served_once(proc)


def test_an_sglang_found_by_an_editable_install_finder_is_served(tmp_path):
    # pip's editable installs expose a package through a meta-path finder, not a sys.path entry.
    # The SGLang here is a stand-in without `srt`: what counts is that the hook runs at its
    # import (and says it cannot serve it), instead of never hearing of it.
    (tmp_path / "src" / "sglang").mkdir(parents=True)
    (tmp_path / "src" / "sglang" / "__init__.py").write_text("")
    proc = _hooked(
        tmp_path,
        "import importlib.machinery, sys\n"
        "class Editable:\n"
        "    @classmethod\n"
        "    def find_spec(cls, name, path=None, target=None):\n"
        "        if name != 'sglang':\n"
        "            return None\n"
        f"        return importlib.machinery.PathFinder.find_spec(name, [{str(tmp_path / 'src')!r}])\n"
        # ahead of sys.path's finder, so that it wins even where a real SGLang is installed
        "hook = [type(f).__name__ for f in sys.meta_path].index('_AfterSglang')\n"
        "sys.meta_path.insert(hook + 1, Editable)\n"
        "for name in [m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')]:\n"
        "    del sys.modules[name]\n"
        "import sglang\n"
        f"assert sglang.__file__.startswith({str(tmp_path)!r}), sglang.__file__\n",
    )
    assert proc.returncode == 0, proc.stderr
    assert "not serving SGLang host pools" in proc.stderr, proc.stderr


def test_install_called_before_the_first_import_in_an_armed_process_returns(tmp_path):
    # The hook runs install() at the first `import sglang`; an install() of the process's own
    # that makes that import must not wait for itself (it hung on its own lock).
    proc = _hooked(
        tmp_path,
        "import faulthandler, hostkv_rs.sglang as s\n"
        "faulthandler.dump_traceback_later(120, exit=True)\n"
        "s.install()\n"
        "print('installed', s.installed())\n",
    )
    _assert_served_once(proc)
