"""What the command line needs to know about model sources without importing torch.

``rematc solve problem.json`` plans a problem file with no torch in the process (the
import takes seconds, and a Ctrl-C during it was a traceback); :mod:`rematc.trace`, which
loads and traces models, imports this module rather than the other way round.
"""

from __future__ import annotations

import os

SHAPES_KEY = "shapes"  # Problem.meta key: JSON {value name: "float32[4, 64]"}


def is_factory(spec: str) -> bool:
    """``package.module:function`` (and not an existing file)."""
    mod, sep, fn = spec.partition(":")
    return bool(sep) and not os.path.exists(spec) and all(
        part.isidentifier() for part in (*mod.split("."), fn)
    )
