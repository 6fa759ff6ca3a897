"""`python -m hostkv_rs` is the `hostkv-rs` command."""

import sys

from hostkv_rs.tools.cli import main

sys.exit(main())
