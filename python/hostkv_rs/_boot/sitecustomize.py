"""Run at interpreter start when hostkv_rs's launcher put this directory on PYTHONPATH (see
hostkv_rs.launch). It arms hostkv_rs only under HOSTKV_RS_SGLANG=1, then runs the
sitecustomize this one shadows, if there is one."""

import importlib.machinery
import importlib.util
import os
import sys


def _arm():
    from hostkv_rs.launch import arm, switched_on

    if switched_on():
        arm()


def _chain():
    # realpath: this folder reached by another path (a symlink) would load this file again
    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    _arm()
except Exception as exc:  # noqa: BLE001 - never stop an interpreter from starting
    print(f"hostkv_rs: launcher hook failed: {exc!r}", file=sys.stderr)
_chain()
