"""Old import path of `hostkv_rs.tools.bench`, kept for code written against it: this name is that
module itself (same object, so attributes and patches are shared)."""

import sys

from hostkv_rs.tools import bench as _module

sys.modules[__name__] = _module
