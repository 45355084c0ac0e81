"""Optional outputs of a run beyond metrics.jsonl: Weights & Biases logging and the loss-curve PNG.

W&B gets exactly the records metrics.jsonl gets (same keys; nested MoE statistics flattened to 'moe/<layer>/...'),
on rank 0 only. It is imported only when metrics.wandb is on; WANDB_MODE=offline logs to RUN_DIR/wandb without an
account (`wandb sync` uploads it later).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class WandbSink:
    def __init__(self, run_dir: Path, project: str, config: dict):
        try:
            import wandb
        except ImportError:
            raise ValueError("metrics.wandb = true needs the wandb package: pip install -e .[wandb] (or set "
                             "metrics.wandb = false)") from None
        self.wandb = wandb
        os.makedirs(run_dir, exist_ok=True)
        self.run = wandb.init(project=project, dir=str(run_dir), name=Path(run_dir).name, config=config,
                              resume="allow", id=_run_id(run_dir))

    def log(self, step: int, values: dict) -> None:
        self.run.log(_flatten(values), step=step)

    def close(self) -> None:
        self.run.finish()


def _run_id(run_dir: Path) -> str:
    """One W&B run per run directory, so a resumed run continues the same curve."""
    marker = Path(run_dir) / "wandb-run-id"
    if not marker.is_file():
        import uuid

        marker.write_text(uuid.uuid4().hex[:12])
    return marker.read_text().strip()


def _flatten(values: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, f"{name}/"))
        elif isinstance(value, (int, float, str)):  # strings too: mfu is "unknown" without a peak FLOP/s
            out[name] = value
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
            out.update({f"{name}/{i}": v for i, v in enumerate(value)})
    return out


def write_loss_curve(metrics_path: Path, png_path: Path) -> Path | None:
    """Training (and validation) loss against the step, from metrics.jsonl; None when nothing was logged."""
    if not metrics_path.is_file():
        return None
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    val = [(r["step"], r["val_loss"]) for r in records if isinstance(r.get("val_loss"), (int, float))]
    if not train:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="val loss", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per trained token)")
    ax.set_title(Path(metrics_path).parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    tmp = png_path.with_suffix(".tmp.png")
    save_figure(fig, str(tmp))
    os.replace(tmp, png_path)  # never a half-written PNG beside summary.json
    return png_path
