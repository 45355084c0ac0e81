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
