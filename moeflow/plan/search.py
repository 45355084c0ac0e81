"""Enumerate layouts, score each with the memory and time model, rank them.

A layout: world = dp_replicate * dp_shard * cp * tp * pp (cp only when pinned, --cp), with tp inside a node (a
search choice: TP across nodes is never fast); every layout listed also passes ParallelDims
(moeflow/core/parallel_dims.py), the rules the trainer checks (so the planner never recommends what `moeflow train`
refuses); zero 1/2/3 acts on dp_shard (with dp_shard = 1 only zero 1 is listed, it is plain replication);
micro_batch and activation checkpointing fill the rest; with pp > 1 the pipeline schedule too
(moeflow.plan.schedule.SEARCHED, with the stages per rank the trainer uses), keeping per layout the fastest schedule
that fits (scoring memory for the others only when the faster ones do not fit: the search stays under a second).
Under flash attention "selective" recomputation is what "none" already does (moeflow.plan.compute), so only none and
full are listed, the trainer's choices.
When no layout fits, the layouts are scored again with ZeRO-Offload (moeflow.plan.memory): parallel.offload =
'optimizer' (the optimizer's state in host memory) for every ZeRO stage and 'params' (the shards there) for ZeRO-3.
Feasible = fits in device (and, offloaded, host) memory and the global batch splits into whole micro-batches."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from moeflow.core.parallel_dims import ParallelDims
from moeflow.core.schedules import SCHEDULES, resolve_schedule
from moeflow.plan.layout import AC_MODES, Job, Layout
from moeflow.plan.memory import memory_per_gpu
from moeflow.plan.schedule import SEARCHED, ZERO_BUBBLE, schedule_refusal
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
        d.update(schedule=self.layout.schedule_label, feasible=self.feasible, memory_gb=self.memory_gb,
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
    pp_schedule: str | None = None
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
        if self.pp_schedule is not None:
            try:
                self.pp_schedule = resolve_schedule(self.pp_schedule)
            except ValueError as e:
                raise ValueError(str(e).replace("parallel.pp_schedule", "--pp-schedule")) from None
        # The pinned sizes against the model, by the trainer's own rules.
        refusal = trainer_refusal(job, self.tp or 1, self.pp or 1, self.ep or 1, 1, 3, self.pp_schedule or "1F1B",
                                  self.cp or 1)
        if refusal:
            raise ValueError(f"the pinned sizes cannot train this model: {refusal}")


def trainer_refusal(job: Job, tp: int, pp: int, ep: int, dp_replicate: int, zero: int,
                    pp_schedule: str = "1F1B", cp: int = 1) -> str | None:
    """Why `moeflow train` would refuse these sizes for this model (ParallelDims), or None."""
    try:
        dims = ParallelDims(job.world, dp_replicate=dp_replicate, tp=tp, pp=pp, ep=ep, zero=zero,
                            pp_schedule=pp_schedule, cp=cp)
        dims.check_model(job.model)
        dims.check_sequence(job.seq_len)
    except ValueError as e:
        return str(e)
    return None


def schedules_for(job: Job, cons: Constraints, pp: int) -> list[str]:
    if pp == 1:
        return ["1F1B"]
    return [cons.pp_schedule] if cons.pp_schedule else list(SEARCHED)


def candidates(job: Job, cons: Constraints | None = None):
    """Every layout the trainer runs, grouped: each group is one layout under each pipeline schedule."""
    cons = cons or Constraints()
    acs = [ac for ac in AC_MODES if not (job.flash_attention and ac == "selective")]
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
                        # ZeRO-3 under a zero-bubble schedule runs as ZeRO-2 (the trainer keeps the parameters
                        # gathered for the step: moeflow.parallel.pipeline), so it is listed as ZeRO-2 only
                        scheds = [x for x in schedules_for(job, cons, pp)
                                  if not (zero == 3 and pp > 1 and x in ZERO_BUBBLE and cons.zero is None)
                                  and not trainer_refusal(job, tp, pp, ep, dp // dp_shard, zero, x, cp)]
                        for mb in MICRO_BATCHES:
                            runnable = [x for x in scheds if _microbatches_ok(job, dp, pp, mb, x)]
                            for ac in acs:
                                group = [Layout(ParallelDims(job.world, dp_replicate=dp // dp_shard, tp=tp, pp=pp,
                                                             ep=ep, zero=zero, pp_schedule=x, cp=cp), mb, ac)
                                         for x in runnable]
                                if group:
                                    yield group


def _microbatches_ok(job: Job, dp: int, pp: int, mb: int, schedule: str) -> bool:
    """torch's limits on the pipeline micro-batches (m >= pp for 1F1B, ...); an uneven split is kept here and
    reported by `evaluate` as infeasible."""
    seqs, rem = divmod(job.global_batch_tokens // job.seq_len, dp * mb)
    if pp == 1 or rem or seqs == 0:
        return True
    v = Layout(ParallelDims(pp, pp=pp, zero=1, pp_schedule=schedule), mb, "none").stages_per_rank
    return schedule_refusal(schedule, seqs, pp, v) is None


def memory_layout(lay: Layout) -> Layout:
    """The layout whose memory `lay` has when the trainer runs it: under a zero-bubble schedule ZeRO-3 keeps the
    parameters gathered for the whole step (moeflow.parallel.pipeline), ZeRO-2's memory."""
    zb3 = lay.zero == 3 and lay.pp > 1 and lay.pp_schedule in ZERO_BUBBLE
    return lay.with_dims(zero=2) if zb3 else lay


def evaluate(job: Job, lay: Layout, time: dict | None = None) -> Result:
    mem = memory_per_gpu(job, memory_layout(lay))
    m = lay.num_micro_batches(job)
    if m == 0:
        seqs = job.global_batch_tokens // job.seq_len
        return Result(lay, False, mem, {}, f"the {seqs} sequences do not split into dp={lay.dp} x "
                      f"micro_batch={lay.micro_batch} whole micro-batches")
    t = time or step_time(job, lay)
    cap = job.gpu.memory_gb
    if mem["host"] > job.gpu.host_gb:
        return Result(lay, False, mem, t, f"offloads {mem['host']:.1f} GB > {job.gpu.host_gb:.0f} GB of host memory "
                      f"per GPU")
    if mem["total"] > cap:
        part = max((k for k in ("params", "grads", "optimizer", "activations")), key=lambda k: mem[k])
        return Result(lay, False, mem, t, f"needs {mem['total']:.1f} GB > {cap:.0f} GB per GPU "
                      f"(short by {mem['total'] - cap:.2f} GB; largest part: {part} {mem[part]:.1f} GB)")
    return Result(lay, True, mem, t)


def best_of_group(job: Job, group: list[Layout]) -> tuple[Result, int]:
    """The fastest schedule of one layout that fits (else the fastest), and how many layouts were scored."""
    if len(group) == 1:
        return evaluate(job, group[0]), 1
    if group[0].num_micro_batches(job) == 0:
        return evaluate(job, group[0]), len(group)
    timed = sorted(((step_time(job, lay), lay) for lay in group), key=lambda x: x[0]["step_s"])
    first = evaluate(job, timed[0][1], timed[0][0])
    if first.feasible or not first.layout.stages_per_rank > 1:
        return first, len(group)
    # Only the interleaved schedules hold more activations (moeflow.plan.schedule.in_flight): the fastest of
    # the others is the one other memory figure the group has.
    for t, lay in timed:
        if SCHEDULES[lay.pp_schedule].placement != "loop":
            r = evaluate(job, lay, t)
            return (r if r.feasible else first), len(group)
    return first, len(group)


def search(job: Job, cons: Constraints | None = None) -> list[Result]:
    """All candidate layouts scored; feasible first by tokens/s/GPU, then infeasible by overshoot. With pp > 1 each
    layout appears once, under its fastest schedule that fits."""
    job.validate()
    if cons:
        cons.check(job)
    scored = [best_of_group(job, group) for group in candidates(job, cons)]
    if not any(r.feasible for r, _ in scored):
        # ZeRO-Offload only when nothing fits on the devices: it buys memory with PCIe traffic and a host step;
        # the optimizer's state alone (any ZeRO stage, copies once per step) or all of ZeRO-3's shards
        scored += [best_of_group(job, [replace(lay, offload=offload) for lay in group])
                   for group in candidates(job, cons) for offload in ("optimizer", "params")
                   if offload == "optimizer" or group[0].zero == 3]
    results = [r for r, _ in scored]
    job.stats.cache["searched"] = sum(n for _, n in scored)
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
    if need <= cap and best.memory_gb["host"] > job.gpu.host_gb:
        host = min(r.memory_gb["host"] for r in results
                   if r.layout.offload != "none" and r.memory_gb["total"] <= cap)  # (of those the devices hold)
        return (f"the cluster is too small for {job.model.name}: no layout fits in {cap:.0f} GB per {job.gpu.name}, "
                f"and with ZeRO-Offload the leanest needs {host:.1f} GB of host memory per GPU, more than the "
                f"{job.gpu.host_gb:.0f} GB its hosts have. Add GPUs (about "
                f"{job.world * host / job.gpu.host_gb:.0f} in all) or use a larger-memory --gpu")
    if need <= cap:
        return ("no layout fits: the global batch does not split into whole micro-batches for any layout; "
                "make --global-batch-tokens a multiple of --seq-len x the number of GPUs")
    return (
        f"the cluster is too small for {job.model.name}: the leanest layout ({best.layout.short()}) needs "
        f"{need:.1f} GB per GPU but a {job.gpu.name} has {cap:.0f} GB (short by {need - cap:.1f} GB). "
        f"Add GPUs (about {job.world * need / cap:.0f} in all), use a larger-memory --gpu, or a shorter --seq-len"
    )
