"""Enumerate layouts, score each with the memory and time model, rank them.

A layout: world = dp_replicate * dp_shard * cp * tp * pp (cp only when pinned, --cp), with tp inside a node
(a search choice: TP across nodes is never fast); every layout listed also passes moeflow.layout.ParallelDims,
the rules the trainer checks (so the planner never recommends what `moeflow train` refuses); zero 1/2/3 acts on
dp_shard (with dp_shard = 1 only zero 1 is listed, it is plain replication); micro_batch and activation
checkpointing fill the rest. Feasible = fits in memory and the global batch splits into whole micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moeflow.layout import ParallelDims
from moeflow.plan.layout import AC_MODES, Job, Layout
from moeflow.plan.memory import memory_per_gpu
from moeflow.plan.time import step_time

MICRO_BATCHES = (1, 2, 4, 8)


def powers_of_two_upto(n: int) -> list[int]:
    out, p = [], 1
    while p <= n:
        out.append(p)
        p *= 2
    return out


@dataclass
class Result:
    layout: Layout
    feasible: bool
    memory_gb: dict
    time: dict
    reason: str = ""

    def as_dict(self) -> dict:
        d = self.layout.as_dict()
        d.update(feasible=self.feasible, memory_gb=self.memory_gb,
                 tokens_per_s_per_gpu=self.time.get("tokens_per_s_per_gpu", 0.0),
                 mfu=self.time.get("mfu", 0.0), time_s=self.time, reason=self.reason)
        return d


@dataclass
class Constraints:
    """Sizes the user pinned (None = search). Contradictions raise ValueError in `check`."""

    tp: int | None = None
    pp: int | None = None
    ep: int | None = None
    zero: int | None = None
    cp: int | None = None  # context parallelism is planned only when pinned (None: 1)
    extra: dict = field(default_factory=dict)

    def check(self, job: Job) -> None:
        w, g = job.world, job.gpus_per_node
        if self.tp is not None and (self.tp < 1 or self.tp > g or g % self.tp):
            raise ValueError(f"--tp ({self.tp}) must divide --gpus-per-node ({g}); TP stays inside a node")
        if self.pp is not None and (self.pp < 1 or w % self.pp):
            raise ValueError(f"--pp ({self.pp}) must divide the {w} GPUs")
        if self.tp and self.pp and w % (self.tp * self.pp):
            raise ValueError(f"--tp ({self.tp}) x --pp ({self.pp}) must divide the {w} GPUs; lower one")
        if self.ep is not None and (self.ep < 1 or w % self.ep):
            raise ValueError(f"--ep ({self.ep}) must divide the {w} GPUs")
        if self.zero is not None and self.zero not in (1, 2, 3):
            raise ValueError(f"--zero ({self.zero}) must be 1, 2 or 3")
        if self.cp is not None and (self.cp < 1 or w % (self.cp * (self.tp or 1) * (self.pp or 1))):
            raise ValueError(f"--cp ({self.cp}) x --tp x --pp must divide the {w} GPUs")
        # The pinned sizes against the model, by the trainer's own rules.
        refusal = trainer_refusal(job, self.tp or 1, self.pp or 1, self.ep or 1, 1, 3, self.cp or 1)
        if refusal:
            raise ValueError(f"the pinned sizes cannot train this model: {refusal}")


def trainer_refusal(job: Job, tp: int, pp: int, ep: int, dp_replicate: int, zero: int, cp: int = 1) -> str | None:
    """Why `moeflow train` would refuse these sizes for this model (moeflow.layout.ParallelDims), or None."""
    try:
        dims = ParallelDims(job.world, dp_replicate=dp_replicate, tp=tp, pp=pp, ep=ep, zero=zero, cp=cp)
        dims.check_model(job.model)
        dims.check_sequence(job.seq_len)
    except ValueError as e:
        return str(e)
    return None


def candidates(job: Job, cons: Constraints | None = None):
    cons = cons or Constraints()
    cfg, w, g = job.model, job.world, job.gpus_per_node
    tps = [t for t in powers_of_two_upto(g) if g % t == 0]
    pps = [p for p in powers_of_two_upto(min(cfg.n_layers, 64)) if w % p == 0]
    E = cfg.moe.num_experts if cfg.is_moe else 1
    cp = cons.cp or 1
    for tp in tps if cons.tp is None else [cons.tp]:
        for pp in pps if cons.pp is None else [cons.pp]:
            if w % (tp * pp * cp):
                continue
            dp = w // (tp * pp * cp)
            # dp_shard: the whole dp group (FSDP / ZeRO) or a power of two inside it (HSDP)
            shards = sorted({d for d in powers_of_two_upto(dp) if dp % d == 0} | {dp})
            for dp_shard in shards:
                borrowable = dp_shard * cp  # EP borrows from dp_shard x cp
                eps = [e for e in powers_of_two_upto(borrowable) if E % e == 0 and borrowable % e == 0]
                for ep in eps if cons.ep is None else [cons.ep]:
                    if borrowable % ep:
                        continue
                    zeros = (1,) if dp_shard == 1 else (1, 2, 3)
                    for zero in zeros if cons.zero is None else [cons.zero]:
                        if trainer_refusal(job, tp, pp, ep, dp // dp_shard, zero, cp):
                            continue
                        for mb in MICRO_BATCHES:
                            for ac in AC_MODES:
                                yield Layout(dp // dp_shard, dp_shard, tp, pp, ep, zero, mb, ac, cp)


def evaluate(job: Job, lay: Layout) -> Result:
    mem = memory_per_gpu(job, lay)
    m = lay.num_micro_batches(job)
    if m == 0:
        seqs = job.global_batch_tokens // job.seq_len
        return Result(lay, False, mem, {}, f"the {seqs} sequences do not split into dp={lay.dp} x "
                      f"micro_batch={lay.micro_batch} whole micro-batches")
    t = step_time(job, lay)
    cap = job.gpu.memory_gb
    if mem["total"] > cap:
        part = max((k for k in ("params", "grads", "optimizer", "activations")), key=lambda k: mem[k])
        return Result(lay, False, mem, t, f"needs {mem['total']:.1f} GB > {cap:.0f} GB per GPU "
                      f"(short by {mem['total'] - cap:.2f} GB; largest part: {part} {mem[part]:.1f} GB)")
    return Result(lay, True, mem, t)


def search(job: Job, cons: Constraints | None = None) -> list[Result]:
    """All candidate layouts scored; feasible first by tokens/s/GPU, then infeasible by overshoot."""
    job.validate()
    if cons:
        cons.check(job)
    results = [evaluate(job, lay) for lay in candidates(job, cons)]
    if not results:
        raise ValueError(
            "no layout matches the pinned sizes on this cluster; drop --tp/--pp/--ep/--zero or change "
            "--nodes / --gpus-per-node"
        )
    ok = sorted((r for r in results if r.feasible), key=lambda r: -r.time["tokens_per_s_per_gpu"])
    bad = sorted((r for r in results if not r.feasible and r.time),
                 key=lambda r: (r.memory_gb["total"], -r.time.get("tokens_per_s_per_gpu", 0)))
    return ok + bad


def shortfall_message(job: Job, results: list[Result]) -> str:
    """Why nothing fits: the smallest memory any layout needs vs what a GPU has."""
    best = min(results, key=lambda r: r.memory_gb["total"])
    need, cap = best.memory_gb["total"], job.gpu.memory_gb
    if need <= cap:
        return ("no layout fits: the global batch does not split into whole micro-batches for any layout; "
                "make --global-batch-tokens a multiple of --seq-len x the number of GPUs")
    return (
        f"the cluster is too small for {job.model.name}: the leanest layout ({best.layout.short()}) needs "
        f"{need:.1f} GB per GPU but a {job.gpu.name} has {cap:.0f} GB (short by {need - cap:.1f} GB). "
        f"Add GPUs (about {job.world * need / cap:.0f} in all), use a larger-memory --gpu, or a shorter --seq-len"
    )
