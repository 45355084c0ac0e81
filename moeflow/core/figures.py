"""Writing the PNG charts of the command-line tools (matplotlib without a display)."""

from __future__ import annotations

import os


def save_figure(fig, path: str) -> None:
    """Lay out `fig`, write it to `path` (creating its folder) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_png_option(write, data, path: str, prog: str) -> bool:
    """A command's --png: write(data, path); False after a one-line error naming the option (not a traceback)
    when the path cannot be written."""
    import sys

    try:
        write(data, path)
    except OSError as e:
        print(f"{prog}: error: --png {path}: {e.strerror or e}; pass a writable file path", file=sys.stderr)
        return False
    return True
