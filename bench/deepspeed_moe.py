"""moeflow's expert-parallel MoE layer against DeepSpeed's MoE layer (deepspeed.moe.layer.MoE), EP=2, one machine.

    .venv/bin/python bench/deepspeed_moe.py            # 60 interleaved repeats
    .venv/bin/python bench/deepspeed_moe.py --quick    # 5 repeats: a smoke run

DeepSpeed is a peer here, never a dependency of moeflow: the script makes its own virtual environment,
bench/.venv-deepspeed (git-ignored), with python3.11, torch==2.13.0 (the CPU build, as moeflow's) and deepspeed
(DS_BUILD_OPS=0: nothing compiles; DS_ACCELERATOR=cpu: its CPU accelerator, which falls back to gloo when
oneccl_bindings_for_pytorch is absent), and runs DeepSpeed's layer in processes started from that venv. Only
DeepSpeed's public API is used: MoE(...), MoE.set_deepspeed_parallelism(), MoE.forward's (output, l_aux,
exp_counts), deepspeed.init_distributed.

Shape (per rank): T=1024 tokens, E=16 experts, top-4, D=F=256, fp32, one thread per rank, gloo, 2 ranks (EP=2).
Both layers hold the same weights: moeflow's router gate and SwiGLU experts w2(silu(w1 x) * w3 x) (no biases),
copied into DeepSpeed's TopKGate.wg and into moeflow's FeedForward (a SwiGLU nn.Module) given to DeepSpeed's MoE
as its expert (the same three D x F matmuls per row: the FLOPs per routed row match);
both route by softmax, top-4, weights renormalised
over the kept experts. Cases, each a pair of processes (rank 0 and rank 1):

  moeflow         moeflow.parallel.expert.apply_expert_parallel on a moeflow MoE (dropless, the trainer's
                  defaults: 1 chunk, overlap on CUDA, off on a CPU)
  moeflow async   the same with overlap=True (dispatch / combine asynchronous), to tell their cost apart
  ds drop cf1.0   DeepSpeed MoE, its defaults: capacity_factor=1.0, drop_tokens=True (drop_policy 'probs')
  ds no drop      DeepSpeed MoE, drop_tokens=False (capacity = the largest expert load over the EP group)

and, in this process, moeflow's MoE with all 16 experts on 1024 tokens (the same expert work an EP rank does on
average; bench/ep_overlap.py's baseline). The worker processes stay alive and wait on their stdin; the driver
asks each pair for one timed forward + backward at a time, rotating the order every repeat, so the cases
interleave and see the same machine state. Reported: each rank's median ms, the slowest rank's; DeepSpeed's
dropped fraction of (token, expert) assignments (from the exp_counts it returns, checked against the routing
recomputed here), the expert rows each rank computes, and the outputs compared first (moeflow against DeepSpeed
no-drop must agree; with drops, the tokens that lost an expert differ). Writes bench/out/deepspeed_moe.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "bench", "out")
VENV = os.path.join(REPO, "bench", ".venv-deepspeed")
DS_PY = os.path.join(VENV, "bin", "python")
TORCH_PIN = "torch==2.13.0"

T, E, K, D, F_ = 1024, 16, 4, 256, 256
WORLD = 2
CF = 1.0
CASES = ["moeflow", "moeflow_async", "ds_drop", "ds_nodrop"]
LABELS = {"baseline": "moeflow MoE, 1 process, 16 experts (baseline)",
          "moeflow": "moeflow EP=2, dropless (trainer defaults)",
          "moeflow_async": "moeflow EP=2, dropless, overlap on",
          "ds_drop": "DeepSpeed EP=2, drop_tokens=True, cf 1.0",
          "ds_nodrop": "DeepSpeed EP=2, drop_tokens=False"}


# ---------------------------------------------------------------------------------------------- the venv


def ensure_venv() -> str:
    """bench/.venv-deepspeed with torch==2.13.0 (CPU) and deepspeed; made once, reused after."""
    env = dict(os.environ, DS_BUILD_OPS="0", DS_ACCELERATOR="cpu")
    if not os.path.exists(DS_PY):
        py = shutil.which("python3.11") or sys.executable
        print(f"making {VENV} ({py} -m venv; pip install {TORCH_PIN}; pip install deepspeed)", flush=True)
        subprocess.run([py, "-m", "venv", VENV], check=True)
        pip = [DS_PY, "-m", "pip", "install", "--quiet"]
        # torch first and pinned: an unpinned torch (what deepspeed asks for) would pull a CUDA build
        subprocess.run(pip + [TORCH_PIN], check=True, env=env)
        subprocess.run(pip + ["deepspeed"], check=True, env=env)
    probe = subprocess.run([DS_PY, "-c", "import torch, deepspeed, importlib.metadata as m; "
                            "print(torch.__version__, deepspeed.__version__, "
                            "any(d.metadata['Name'].startswith('nvidia') for d in m.distributions()))"],
                           check=True, env=env, capture_output=True, text=True)
    torch_v, ds_v, nvidia = probe.stdout.split()[-3:]
    if not torch_v.startswith("2.13.0") or "+cpu" not in torch_v or nvidia == "True":
        raise SystemExit(f"{VENV} has torch {torch_v} (nvidia packages: {nvidia}); expected {TORCH_PIN}+cpu: "
                         f"remove it and rerun")
    return f"deepspeed {ds_v}, torch {torch_v}"


# ---------------------------------------------------------------------------------------------- shared state


def make_state(path: str) -> dict:
    """Weights (moeflow's layout) and each rank's input and output gradient, saved for every process."""
    torch.manual_seed(0)
    state = {"gate": torch.randn(E, D) * 0.02, "w1": torch.randn(E, D, F_) * 0.02,
             "w3": torch.randn(E, D, F_) * 0.02, "w2": torch.randn(E, F_, D) * 0.02}
    for r in range(WORLD):
        g = torch.Generator().manual_seed(100 + r)
        state[f"x{r}"] = torch.randn(T, D, generator=g)
        state[f"gy{r}"] = torch.randn(T, D, generator=g)
    torch.save(state, path)
    return state


def make_moeflow(state: dict):
    sys.path.insert(0, REPO)
    from moeflow.core.model_config import ModelConfig, MoEConfig
    from moeflow.models.moe import MoE

    cfg = ModelConfig(dim=D, moe=MoEConfig(num_experts=E, top_k=K, ffn_dim=F_, expert_impl="grouped_mm"))
    moe = MoE(cfg)
    with torch.no_grad():
        moe.router.gate.weight.copy_(state["gate"])
        for name in ("w1", "w3", "w2"):
            getattr(moe.experts, name).copy_(state[name])
    return moe


def make_deepspeed(state: dict, rank: int, drop_tokens: bool):
    from deepspeed.moe.layer import MoE

    sys.path.insert(0, REPO)
    from moeflow.models.moe import FeedForward  # moeflow's dense SwiGLU: w2(silu(w1 x) * w3 x), no biases

    layer = MoE(hidden_size=D, expert=FeedForward(D, F_), num_experts=E, ep_size=WORLD, k=K, capacity_factor=CF,
                eval_capacity_factor=CF, drop_tokens=drop_tokens)
    layer.set_deepspeed_parallelism()
    L = E // WORLD
    experts = layer.deepspeed_moe.experts.deepspeed_experts  # this rank's experts [rank * L, (rank + 1) * L)
    assert len(experts) == L
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(state["gate"])
        for i, ex in enumerate(experts):
            e = rank * L + i
            ex.w1.weight.copy_(state["w1"][e].T)
            ex.w3.weight.copy_(state["w3"][e].T)
            ex.w2.weight.copy_(state["w2"][e].T)
    return layer


def routing_counts(state: dict, rank: int) -> torch.Tensor:
    """Assignments per expert of this rank's tokens (softmax, top-4), recomputed here."""
    probs = (state[f"x{rank}"] @ state["gate"].T).softmax(-1)
    idx = probs.topk(K, dim=-1).indices
    return torch.bincount(idx.flatten(), minlength=E)


# ---------------------------------------------------------------------------------------------- workers


def worker(case: str, rank: int, tmp: str) -> None:
    """One rank of one case; answers the driver's commands on stdin: check, time N, quit."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # DeepSpeed prints to stdout; keep the protocol's pipe clean
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    state = torch.load(f"{tmp}/state.pt")
    init = f"file://{tmp}/store_{case}"
    if case.startswith("moeflow"):
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
        from moeflow.parallel.expert import apply_expert_parallel

        layer = make_moeflow(state)
        # the trainer's defaults (1 chunk; overlap chosen by device: off here); moeflow_async: overlap on
        apply_expert_parallel(layer, None, ranks_per_node=WORLD, overlap=True if case == "moeflow_async" else None)

        def forward(x):
            return layer(x), None
    else:
        import deepspeed
        import deepspeed.comm as dist

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method=init, rank=rank,
                                   world_size=WORLD, verbose=False)
        layer = make_deepspeed(state, rank, drop_tokens=case == "ds_drop")

        def forward(x):
            out, _l_aux, exp_counts = layer(x)
            return out, exp_counts

    x = state[f"x{rank}"].clone().requires_grad_()
    gy = state[f"gy{rank}"]

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out, counts = forward(x)
        out.backward(gy)
        return out, counts

    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "check":
            out, counts = step()
            torch.save({"y": out.detach(), "dx": x.grad, "exp_counts": counts}, f"{tmp}/check_{case}_{rank}.pt")
            reply.write("ok\n")
        elif cmd[0] == "time":
            ms = []
            for _ in range(int(cmd[1])):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                ms.append((time.perf_counter() - t0) * 1e3)
            reply.write(json.dumps(ms) + "\n")
        elif cmd[0] == "quit":
            break
    dist.barrier()
    reply.write("bye\n")
    os._exit(0)


class Pair:
    """The two ranks of one case, started from its venv, driven over their stdin / stdout."""

    def __init__(self, case: str, tmp: str):
        self.case = case
        py = sys.executable if case.startswith("moeflow") else DS_PY
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu", DS_BUILD_OPS="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29517 + CASES.index(case)),
                   PYTHONPATH=REPO if case.startswith("moeflow") else "")
        self.logs = [f"{tmp}/log_{case}_{r}.txt" for r in range(WORLD)]
        self.procs = [subprocess.Popen([py, os.path.abspath(__file__), "--worker", case, "--rank", str(r),
                                        "--tmp", tmp], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=open(self.logs[r], "w"), text=True, env=env)
                      for r in range(WORLD)]

    def ask(self, command: str) -> list[str]:
        for p in self.procs:
            p.stdin.write(command + "\n")
            p.stdin.flush()
        answers = [p.stdout.readline().strip() for p in self.procs]
        if not all(answers):
            tails = "".join(f"\n--- {log}\n" + open(log).read()[-3000:] for log in self.logs)
            raise RuntimeError(f"{self.case}: a worker died on {command!r}{tails}")
        return answers

    def close(self) -> None:
        try:
            self.ask("quit")
        finally:
            for p in self.procs:
                p.wait(timeout=60)


# ---------------------------------------------------------------------------------------------- driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="5 repeats")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.rank, args.tmp)
    repeats = 5 if args.quick else args.repeats
    ds_versions = ensure_venv()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        state = make_state(f"{tmp}/state.pt")
        pairs = {case: Pair(case, tmp) for case in CASES}
        try:
            results = run(pairs, state, tmp, repeats)
        finally:
            for pair in pairs.values():
                pair.close()
    results.update(machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                   torch=torch.__version__, deepspeed=ds_versions, repeats=repeats,
                   shape={"tokens_per_rank": T, "experts": E, "top_k": K, "hidden": D, "ffn": F_, "ep": WORLD,
                          "dtype": "fp32", "threads_per_rank": 1, "backend": "gloo", "capacity_factor": CF})
    report(results, args.out)


def run(pairs: dict, state: dict, tmp: str, repeats: int) -> dict:
    # --- the same computation first
    for pair in pairs.values():
        pair.ask("check")
    chk = {c: [torch.load(f"{tmp}/check_{c}_{r}.pt") for r in range(WORLD)] for c in CASES}
    counts = [routing_counts(state, r) for r in range(WORLD)]
    for c in ("ds_drop", "ds_nodrop"):
        for r in range(WORLD):
            assert torch.equal(chk[c][r]["exp_counts"].long(), counts[r]), f"{c} rank {r}: routing differs"
    cap = max(math.ceil(T / E * CF * K), 4)
    dropped = sum(int((cnt - cap).clamp(min=0).sum()) for cnt in counts) / (WORLD * T * K)
    nodrop_cap = int(max(int(cnt.max()) for cnt in counts))
    L = E // WORLD
    local = [int(sum(cnt[r * L:(r + 1) * L].sum() for cnt in counts)) for r in range(WORLD)]
    rows = {"moeflow": local, "moeflow_async": local,
            "ds_drop": [E * cap] * WORLD, "ds_nodrop": [E * nodrop_cap] * WORLD, "baseline": [T * K]}
    parity = {}
    for c in ("moeflow_async", "ds_drop", "ds_nodrop"):
        y = torch.cat([chk[c][r]["y"] for r in range(WORLD)])
        dx = torch.cat([chk[c][r]["dx"] for r in range(WORLD)])
        y0 = torch.cat([chk["moeflow"][r]["y"] for r in range(WORLD)])
        dx0 = torch.cat([chk["moeflow"][r]["dx"] for r in range(WORLD)])
        differ = ((y - y0).abs().amax(-1) > 1e-5).float().mean().item()
        parity[c] = {"max_abs_y": (y - y0).abs().max().item(), "max_abs_dx": (dx - dx0).abs().max().item(),
                     "tokens_differing": differ}
    for c in ("moeflow_async", "ds_nodrop"):
        assert parity[c]["max_abs_y"] < 1e-5 and parity[c]["max_abs_dx"] < 1e-5, parity
    print(f"outputs: moeflow vs DeepSpeed no-drop max |dy| {parity['ds_nodrop']['max_abs_y']:.1e}, "
          f"|dx| {parity['ds_nodrop']['max_abs_dx']:.1e}; vs DeepSpeed drop cf 1.0: "
          f"{parity['ds_drop']['tokens_differing']:.1%} of tokens differ (dropped assignments {dropped:.2%})")

    # --- the baseline, in this process
    base = make_moeflow(state)
    bx = state["x0"].clone().requires_grad_()

    def base_step():
        base.zero_grad(set_to_none=True)
        bx.grad = None
        base(bx).backward(state["gy0"])

    # --- warm-up, then interleaved repeats (the order rotates every repeat)
    for pair in pairs.values():
        pair.ask("time 2")
    base_step()
    names = CASES + ["baseline"]
    per_rank = {c: [[] for _ in range(WORLD)] for c in CASES}
    per_rank["baseline"] = [[]]
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            if name == "baseline":
                t0 = time.perf_counter()
                base_step()
                per_rank["baseline"][0].append((time.perf_counter() - t0) * 1e3)
            else:
                for r, answer in enumerate(pairs[name].ask("time 1")):
                    per_rank[name][r] += json.loads(answer)
    med = {n: max(statistics.median(v) for v in per_rank[n]) for n in names}  # the slowest rank's median
    return {"ms": med, "per_rank_ms": per_rank, "dropped_fraction_ds_drop": dropped, "capacity_ds_drop": cap,
            "capacity_ds_nodrop": nodrop_cap, "expert_rows_per_rank": rows, "parity": parity,
            "ratios": {f"{m}/{d}": med[m] / med[d]
                       for m in ("moeflow", "moeflow_async") for d in ("ds_drop", "ds_nodrop")},
            "targets": {"moeflow <= 0.9 x ds_drop": med["moeflow"] <= 0.9 * med["ds_drop"],
                        "moeflow < ds_nodrop": med["moeflow"] < med["ds_nodrop"]}}


def report(res: dict, out: str) -> None:
    ms, rows = res["ms"], res["expert_rows_per_rank"]
    print(f"\n{res['machine']}; torch {res['torch']}; {res['deepspeed']}; median of {res['repeats']} interleaved "
          f"repeats, fwd+bwd, slowest rank")
    print(f"{'layer':<46} {'ms/rank':>8} {'moeflow/x':>9} {'x/baseline':>10} {'expert rows/rank':>16}")
    for n in ["moeflow", "moeflow_async", "ds_drop", "ds_nodrop", "baseline"]:
        print(f"{LABELS[n]:<46} {ms[n]:>8.1f} {ms['moeflow'] / ms[n]:>9.2f} {ms[n] / ms['baseline']:>10.2f} "
              f"{max(rows[n]):>16}")
    print(f"DeepSpeed drop_tokens=True, cf 1.0: capacity {res['capacity_ds_drop']} rows per expert per rank, "
          f"{res['dropped_fraction_ds_drop']:.2%} of (token, expert) assignments dropped; drop_tokens=False: "
          f"capacity {res['capacity_ds_nodrop']}")
    for target, met in res["targets"].items():
        print(f"target {target}: {'met' if met else 'NOT met'}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "deepspeed_moe.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeflow.core.figures import save_figure

    names = ["moeflow", "moeflow_async", "ds_drop", "ds_nodrop", "baseline"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    colors = ["tab:blue", "tab:cyan", "tab:orange", "tab:red", "tab:gray"]
    ax.barh(range(len(names)), [ms[n] for n in names], color=colors)
    ax.set_yticks(range(len(names)), [LABELS[n] for n in names], fontsize=8)
    ax.invert_yaxis()
    for i, n in enumerate(names):
        ax.text(ms[n], i, f" {ms[n]:.1f}", va="center", fontsize=8)
    ax.set_xlabel("fwd+bwd ms per rank (slowest rank's median)")
    ax.set_title(f"MoE layer, EP=2, gloo/CPU: T={T}/rank, E={E}, top-{K}, D=F={D}, fp32", fontsize=8, loc="right")
    save_figure(fig, os.path.join(out, "deepspeed_moe.png"))
    print(f"wrote {out}/deepspeed_moe.json and deepspeed_moe.png")


if __name__ == "__main__":
    main()
