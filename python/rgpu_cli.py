"""Console entry points of rgpu.

A top-level module, apart from the ``rgpu`` package, so that the commands start without
importing torch.
"""

import os
import sys


def opserver() -> None:
    """``rgpu-opserver``: runs the native server shipped inside the package."""
    binary = os.path.join(os.path.dirname(__file__), "rgpu", "bin", "rgpu-opserver")
    if not os.path.exists(binary):
        sys.exit("rgpu-opserver: the native server is not built; run `make` in the rgpu checkout")
    os.execv(binary, [binary] + sys.argv[1:])
