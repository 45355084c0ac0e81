"""GPU smoke checks: one line per check, non-zero exit if any fails. Run through bench/gpu_smoke.sh.

    PASS info: ...           moeflow info (versions, the device)
    PASS moe_block: ...      the MoE block in bf16 (grouped_mm) vs a loop reference; fwd+bwd ms vs the dense
                             matmul floor of the same FLOPs (the ratio); fp32 input under bf16 autocast reaches
                             the experts as bf16 and takes grouped_mm
    PASS ep_world1[...]: ... moeflow.ep at world size 1 on NCCL through every backend (alltoall, hierarchical,
                             allgather, static sizes), async, outputs vs the single-process oracle
    PASS ep_no_host_sync: .. the EP MoE layer with static sizes under torch.cuda.set_sync_debug_mode("error")
    PASS fsdp_bf16_world1:   FSDP2 on a one-rank NCCL mesh under bf16: matmul weights gathered in bf16, loss and
                             gradients as the unsharded model's under autocast
    PASS train_bf16: ...     20 steps of a small MoE model in bf16 on CUDA: loss falls, tokens/s, MFU
    PASS hf_parity: ...      a tiny transformers Qwen3-MoE and its moeflow copy: logits on the GPU
    PASS masked_gqa_attention: packed documents under GQA: attend() equals enable_gqa, and on CUDA no fp32 scores
                             are materialised (peak memory)
    PASS fp8: ...            bench/fp8.py: 50 steps with training.fp8 (tensorwise, rowwise) against bf16, every
                             step's loss within 3% (torchao's float8 kernels need CUDA)
    PASS/SKIP deep_ep: ...   the real DeepEP, if installed

`--device cpu` runs the same checks on the CPU (gloo instead of NCCL, no sync debug mode): how the script
itself is tested on machines without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS: list[tuple[str, str, str]] = []


def check(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                detail = fn(*args, **kwargs)
                status = "SKIP" if isinstance(detail, str) and detail.startswith("skipped") else "PASS"
            except Exception as exc:  # one line per check; the traceback goes to stderr
                traceback.print_exc(file=sys.stderr)
                status, detail = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            RESULTS.append((status, name, detail))
            print(f"{status} {name}: {detail} ({time.perf_counter() - t0:.1f} s)", flush=True)
        return run
    return wrap


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device, repeats: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@check("info")
def info(python: str):
    out = subprocess.run([python, "-m", "moeflow", "info"], capture_output=True, text=True, timeout=120, cwd=REPO)
    if out.returncode:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    lines = out.stdout.strip().splitlines()
    device = next((ln for ln in lines if ln.startswith("cuda:")), "no cuda line")
    return f"{lines[0]}; {device}"


@check("moe_block")
def moe_block(device, T=4096, E=16, K=4, D=1024, F=1024):
    from moeflow.core.model_config import ModelConfig, MoEConfig
    from moeflow.models.moe import MoE

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        T, D, F = 512, 256, 256
    cfg = ModelConfig(dim=D, moe=MoEConfig(num_experts=E, top_k=K, ffn_dim=F, expert_impl="grouped_mm"))
    torch.manual_seed(0)
    moe = MoE(cfg).to(device)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    ref = copy.deepcopy(moe)
    ref.experts.impl = "loop"
    x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype == torch.bfloat16):
        y, y_ref = moe(x), ref(x)
    err = float((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max())
    if err > 2e-2:
        raise AssertionError(f"grouped_mm vs loop relative error {err:.3g}")
    gy = torch.randn_like(y)

    def block():
        moe.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype == torch.bfloat16):
            out = moe(x)
        out.backward(gy)

    a = torch.randn(T * K, D, device=device, dtype=dtype)
    w = torch.randn(D, F, device=device, dtype=dtype)
    w2 = torch.randn(F, D, device=device, dtype=dtype)
    g = torch.randn(T * K, F, device=device, dtype=dtype)
    gd = torch.randn(T * K, D, device=device, dtype=dtype)

    def floor():  # 3 forward and 6 backward matmuls of a SwiGLU over the T*K routed rows: the FLOPs alone
        a @ w, a @ w, g @ w2
        g @ w.t(), a.t() @ g, g @ w.t(), a.t() @ g, gd @ w2.t(), g.t() @ gd

    # What the trainer does: fp32 activations into the block under bf16 autocast. The experts must get bf16 and
    # take grouped_mm (on CUDA an fp32 input falls back to padded bmm: a host sync and padding).
    seen = []
    auto = copy.deepcopy(moe)
    auto.experts.impl = "auto"
    auto.experts.register_forward_pre_hook(lambda m, args: seen.append((args[0].dtype, m.resolve_impl(args[0]))))
    with torch.autocast(device.type, dtype=torch.bfloat16):
        auto(x.detach().float())
    if seen != [(torch.bfloat16, "grouped_mm")]:
        raise AssertionError(f"under bf16 autocast the experts got {seen}, want [(bfloat16, 'grouped_mm')]")

    t_block, t_floor = median_ms(block, device), median_ms(floor, device)
    return (f"T={T} E={E} K={K} D={D} F={F} {str(dtype).split('.')[1]}: {t_block:.2f} ms fwd+bwd, dense floor "
            f"{t_floor:.2f} ms, ratio {t_block / t_floor:.2f}x; grouped_mm vs loop rel err {err:.1e}; fp32 input "
            f"under autocast -> bf16 grouped_mm")


def _init_world1(device):
    import torch.distributed as dist

    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = tempfile.mkdtemp()
    dist.init_process_group(backend, init_method=f"file://{store}/store", rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)


def ep_world1(device):
    from moeflow.ep import Buffer, reference

    _init_world1(device)
    T, D, E, K = 64, 128, 8, 2
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(-1, E, (T, K), generator=g).to(device)
    x = torch.randn(T, D, generator=g).to(device)
    w = torch.rand(T, K, generator=g).to(device)
    ref = reference.dispatch([x.cpu()], [idx.cpu()], E, [w.cpu()])[0]
    for backend, W in (("alltoall", 0), ("hierarchical", 0), ("allgather", 0), ("alltoall", T)):
        @check(f"ep_world1[{backend}{', static' if W else ''}]")
        def one(backend=backend, W=W):
            buf = Buffer(None, backend=backend, ranks_per_node=1)
            recv_x, recv_idx, recv_w, _, handle, event = buf.dispatch(
                x, topk_idx=idx, topk_weights=w, num_experts=E, num_worst_tokens=W, async_finish=True)
            event.current_stream_wait()
            n = ref.x.shape[0]
            assert recv_x.device.type == device.type
            assert torch.equal(recv_x[:n].cpu(), ref.x) and torch.equal(recv_idx[:n].cpu(), ref.topk_idx)
            out, _, event = buf.combine(recv_x, handle, async_finish=True)
            event.current_stream_wait()
            # One rank: a token with any valid expert comes back once, one with none not at all.
            sent = (idx >= 0).any(1, keepdim=True).to(x.dtype)
            assert torch.equal(out, x * sent), float((out - x * sent).abs().max())
            return f"{n} rows, combine(dispatch(x)) == x on {device}"
        one()


@check("ep_no_host_sync")
def ep_no_host_sync(device, T=256, E=8, K=2, D=128):
    from moeflow.core.model_config import ModelConfig, MoEConfig
    from moeflow.models.moe import MoE
    from moeflow.parallel.expert import apply_expert_parallel

    _init_world1(device)
    cfg = ModelConfig(dim=D, moe=MoEConfig(num_experts=E, top_k=K, ffn_dim=D, num_shared_experts=1,
                                           expert_impl="grouped_mm"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    moe = MoE(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():  # a bare MoE's parameters are uninitialised memory (the Transformer initialises them)
        for p in moe.parameters():
            p.normal_(0.0, 0.05)
    ref = copy.deepcopy(moe)
    apply_expert_parallel(moe, None, chunks=2, overlap=True, num_worst_tokens=-1)
    x = torch.randn(T, D, device=device, dtype=dtype, requires_grad=True)
    moe(x).float().sum().backward()  # warm-up outside the debug mode (lazy initialisation may sync)
    debug = (contextlib.nullcontext() if device.type != "cuda" else _sync_debug())
    with debug:
        y = moe(x)
        y.float().sum().backward()
    err = float((y.float() - ref(x).float()).abs().max())
    assert err < (5e-2 if dtype == torch.bfloat16 else 1e-5), err
    return f"forward + backward with no host sync (set_sync_debug_mode('error')), vs local MoE max err {err:.1e}"


@contextlib.contextmanager
def _sync_debug():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@check("fsdp_bf16_world1")
def fsdp_bf16_world1(device, T=256):
    """FSDP2 on a one-rank NCCL mesh under bf16 autocast (moeflow.parallel.fsdp): the blocks' matmul weights
    gathered in bf16, norms, router gates and the head in fp32, loss and gradients as the unsharded model's under
    autocast (bit for bit on a CPU; on a GPU within bf16 noise: CUDA's index_add sums in no fixed order)."""
    from moeflow.core.parallel_dims import ParallelDims
    from moeflow.core.presets import get_preset
    from moeflow.models.layers import RMSNorm
    from moeflow.models.moe import GroupedExperts, Router
    from moeflow.models.transformer import Transformer
    from moeflow.parallel.fsdp import apply_fsdp
    from moeflow.parallel.mesh import build_mesh
    from moeflow.parallel.parallelize import blocks

    _init_world1(device)
    model = Transformer(get_preset("tiny-moe"))
    model.init_weights(seed=0)
    model.to(device)
    ref = copy.deepcopy(model)
    dims = ParallelDims(1)
    apply_fsdp(blocks(model), [model], dims, build_mesh(dims, device.type), torch.bfloat16)
    seen = {}

    def record(module, _inputs, _output):  # the output head stays with its root, in fp32
        bf16_kind = isinstance(module, (torch.nn.Linear, GroupedExperts)) and module is not model.output
        weight = module.w1 if isinstance(module, GroupedExperts) else (
            module.gate.weight if isinstance(module, Router) else getattr(module, "weight", None))
        if bf16_kind or isinstance(module, (RMSNorm, Router)):
            seen.setdefault("matmul" if bf16_kind else "fp32", set()).add(weight.dtype)

    tokens = torch.randint(0, 256, (2, T // 2), device=device)
    losses = []
    for net in (ref, model):
        hook = torch.nn.modules.module.register_module_forward_hook(record) if net is model else None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(net(tokens).float().flatten(0, 1), tokens.flatten())
        loss.backward()
        losses.append(float(loss.detach()))
        if hook:
            hook.remove()
    assert seen == {"matmul": {torch.bfloat16}, "fp32": {torch.float32}}, seen
    grads = [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad, q.grad)
             for p, q in zip(model.parameters(), ref.parameters())]
    rel = max(float((a - b).norm() / b.norm().clamp(min=1e-12)) for a, b in grads)
    assert abs(losses[1] - losses[0]) < 1e-3 * abs(losses[0]) and rel < 2e-2, (losses, rel)
    return (f"blocks' matmul weights gathered in bf16, norms, routers and head fp32; loss {losses[1]:.5f} vs unsharded "
            f"{losses[0]:.5f}, largest gradient difference {rel:.1e} (relative)")


def _train(python: str, device, steps: int, *extra: str) -> tuple[dict, list[float]]:
    """(summary.json, losses) of a short tiny-moe bf16 run of `moeflow train` on `device`."""
    with tempfile.TemporaryDirectory() as run_dir:
        args = [python, "-m", "moeflow", "train", "--model.name=tiny-moe", f"--training.steps={steps}", "--no-progress",
                "--training.dtype=bf16", f"--training.device={device.type}", "--data.max_bytes=1000000",
                "--metrics.tensorboard=false", "--eval.every=0", "--metrics.log_every=1", f"--run-dir={run_dir}",
                "--fresh", *extra]
        out = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO)
        if out.returncode:
            raise RuntimeError((out.stderr.strip().splitlines() or ["no output"])[-1])
        rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        return json.loads((Path(run_dir) / "summary.json").read_text()), [r["loss"] for r in rows if "loss" in r]


@check("train_bf16")
def train_bf16(python: str, device):
    s, _ = _train(python, device, 20 if device.type == "cuda" else 8)  # on a CPU (make test) the script is tested
    if not s["final_loss"] < s["first_loss"]:
        raise AssertionError(f"loss did not fall: {s['first_loss']} -> {s['final_loss']}")
    metrics_mfu = s.get("mfu")
    return (f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}, {s['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {metrics_mfu if metrics_mfu is not None else 'see metrics.jsonl'}")


@check("offload")
def offload(python: str, device):
    """parallel.offload = 'params' (the shards in pinned host memory, copied to the GPU per layer) and 'optimizer'
    (the optimizer's state and step on the host, the gradients and weights copied once per step), with AdamW and
    with Muon (its updates to the GPU for Newton-Schulz and back): the same losses as without (the optimizer on
    another device: bf16-level agreement), at some speed."""
    steps = 10 if device.type == "cuda" else 2
    said = []
    for optimizer in ("adamw", "muon"):
        plain, losses = _train(python, device, steps, "--parallel.offload=none", f"--training.optimizer={optimizer}")
        for mode in ("params", "optimizer"):
            off, off_losses = _train(python, device, steps, f"--parallel.offload={mode}",
                                     f"--training.optimizer={optimizer}")
            worst = max(abs(a - b) / abs(a) for a, b in zip(losses, off_losses))
            if len(off_losses) != len(losses) or worst > 1e-2:
                raise AssertionError(f"{optimizer}, {mode}: offloaded losses {off_losses} differ from {losses} "
                                     f"(relative {worst:.1e})")
            said.append(f"{optimizer} {mode}: losses within {worst:.1e} over {steps} steps, tokens/s "
                        f"{off['tokens_per_s']:,.0f} ({off['tokens_per_s'] / plain['tokens_per_s']:.2f}x)")
    return f"{'; '.join(said)}"


@check("hf_parity")
def hf_parity(device):
    try:
        import transformers
    except ImportError:
        return "skipped: transformers not installed"
    from moeflow.models.hf import from_pretrained

    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=8, num_experts_per_tok=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        model, _ = from_pretrained(folder)
    hf, model = hf.to(device), model.to(device).eval()
    tokens = torch.randint(0, 128, (2, 16), device=device)
    with torch.no_grad():
        err = float((hf(tokens).logits - model(tokens)).abs().max())
    assert err < 1e-4, err
    return f"Qwen3-MoE logits max abs diff {err:.1e} on {device}"


@check("masked_gqa_attention")
def masked_gqa_attention(device, B=1, H=16, Hk=4, S=4096, D=128):
    """Packed documents under GQA (moeflow.models.attention.attend with a mask): the same output as enable_gqa, and
    on CUDA no materialised scores (the math kernel keeps fp32 [B, H, S, S] for backward: 1 GiB at these sizes)."""
    import torch.nn.functional as F

    from moeflow.models.attention import attend, document_causal_mask

    if device.type == "cpu":
        S, H, Hk, D = 256, 4, 2, 32
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, device=device, dtype=dtype, generator=g, requires_grad=True)
               for h in (H, Hk, Hk))
    docs = torch.arange(S, device=device).unsqueeze(0) // (S // 8)  # 8 documents of S / 8 tokens
    mask = document_causal_mask(docs)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    out = attend(q, k, v, mask)
    out.float().sum().backward()
    sync(device)
    grown = (torch.cuda.max_memory_allocated(device) - before) / 2**20 if device.type == "cuda" else 0.0
    scores_mb = B * H * S * S * 4 / 2**20
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    err = float((out.detach().float() - ref.float()).abs().max())
    if err > 2e-2:
        raise AssertionError(f"attend vs enable_gqa max abs diff {err:.3g}")
    if device.type == "cuda" and grown > scores_mb / 2:
        raise AssertionError(f"peak memory grew {grown:.0f} MiB: the math kernel's scores ({scores_mb:.0f} MiB) "
                             "were materialised")
    return (f"B={B} H={H} Hk={Hk} S={S} {str(dtype).split('.')[1]}: vs enable_gqa max abs diff {err:.1e}; "
            f"peak memory grew {grown:.0f} MiB (fp32 scores would be {scores_mb:.0f} MiB)")


@check("fp8")
def fp8_training(python: str, device):
    if device.type != "cuda":
        return "skipped off CUDA (tests/parallel/test_fp8.py runs the CPU recipes)"
    out = subprocess.run([python, "bench/fp8.py", "--steps", "50", "--max-rel", "0.03"], capture_output=True,
                         text=True, timeout=900, cwd=REPO)
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "first loss" not in line]
    if out.returncode:
        raise RuntimeError((out.stderr.strip().splitlines() or out.stdout.strip().splitlines() or ["no output"])[-1])
    # each row: run, first loss, final loss, max rel. diff vs bf16, mean rel. diff, tokens/s, speed vs bf16
    return "; ".join(" ".join(cell.strip() for cell in row.strip("|").split("|")) for row in rows)


@check("deep_ep")
def deep_ep_check(device):
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        return "skipped: deep_ep not installed"
    return "installed (the adapter's checks run in tests/ep/test_deep_ep_adapter.py with the real package)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (to test this script)")
    args = parser.parse_args()
    device = torch.device(args.device)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    python = sys.executable
    info(python)
    moe_block(device)
    ep_world1(device)
    ep_no_host_sync(device)
    fsdp_bf16_world1(device)
    train_bf16(python, device)
    offload(python, device)
    hf_parity(device)
    masked_gqa_attention(device)
    fp8_training(python, device)
    deep_ep_check(device)
    failed = [name for status, name, _ in RESULTS if status == "FAIL"]
    print(f"{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
