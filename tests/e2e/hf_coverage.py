"""The Hugging Face coverage matrix: every MoE architecture of the installed transformers, each capability
checked on two gloo ranks against transformers' own model in one process.

    .venv/bin/python -m tests.e2e.hf_coverage --out bench/results   # the committed results (README's table)
    .venv/bin/python -m tests.e2e.hf_coverage qwen3_moe gpt_oss     # some architectures, printed only

The architectures are found, not listed (tests/support/hf_tiny.py: every modeling file that uses transformers'
experts interface); each gets a tiny random model. Per architecture, with moeflow.parallelize on transformers'
own modules (model.hf_impl = 'transformers'):

  ep=2        expert parallelism (each rank keeps half the experts; tokens travel through moeflow.ep) with
              FSDP2 ZeRO-3 of the rest: 2 AdamW steps give one process's losses and gradient norms
  read        the saved folder read into that layout rank-locally (moeflow/train/hf_sharded_transformers.py,
              through transformers' own checkpoint conversion): every tensor and buffer of each rank equals the
              in-memory model's, parallelized; each rank reads less than the files hold (its half of the experts)
  dp=2        FSDP2 ZeRO-3 alone: the same
  export      the ep=2 run's checkpoint (experts one per key) -> `moeflow convert moeflow-to-hf` -> transformers'
              from_pretrained gives the trained one-process model's loss
  generate    `moeflow generate`'s greedy tokens on the run directory equal transformers' generate on the export
  native      moeflow's own model (model.hf_impl = 'native') gives transformers' logits, where it maps the
              architecture; else the one-line reason
  lora        LoRA adapters (peft.method = 'lora', random factors) on transformers' modules, attention, MLPs and
              every experts weight: written in PEFT's format, PeftModel.from_pretrained on the folder gives
              moeflow's loss, as does the model with the adapters merged into its weights; where it does not,
              peft's own save / load of such an adapter is tried, and a cell names peft when that changes the loss
  tp=2        tensor and sequence parallelism with the MoE folded over tp (its experts spread over the 2 ranks):
              the same check as dp=2 where moeflow takes the layout, else its one-line refusal (given before any
              rank starts)
  pp=2        two pipeline stages (GPipe, 2 micro-batches): the same check as dp=2 where moeflow takes the layout,
              else its one-line refusal
  cp=2        context parallelism (each rank keeps two of the four chunks of every sequence; keys and values
              all-gathered in transformers' attention interface, moeflow/parallel/hf_context.py) with FSDP2
              over both ranks: the same check as dp=2 where moeflow takes the layout, else its one-line refusal

Each cell is "ok" or the reason it is not; a mismatch is a failure, never a cell. Relative tolerance REL on
every comparison (fp32; the summation order differs between layouts, nothing else).
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

REL = 1e-5
STEPS = 2
# AdamW's eps in every comparison. Its first step moves each weight by lr * g / (|g| + eps): about lr * sign(g),
# except where |g| is near eps, where the fraction of lr follows g itself. A gradient element of ~1e-8 - zero up to
# the summation order, which differs between layouts - then moves by a different fraction of lr in each (LongCat-
# Flash's tiny model has a few: the second step's gradient norm then differs by 1.2e-5 with eps 1e-8); at 1e-6
# such elements barely move, and the second step still compares every other gradient.
EPS = 1e-6
S = 12
CAPABILITIES = ("ep=2", "read", "dp=2", "export", "generate", "native", "lora", "tp=2", "pp=2", "cp=2")


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (tp_loss: also over vocab-sharded logits under tensor parallelism)."""
    from moeflow.models.hf_transformers import logits
    from moeflow.parallel.loss import tp_loss

    return tp_loss(logits(model, ids[:, :-1]), ids[:, 1:])


def _close(got: float, want: float, what: str) -> None:
    if abs(got - want) > REL * abs(want) + 1e-12:
        raise AssertionError(f"{what}: {got!r} vs one process {want!r} (relative {abs(got - want) / abs(want):.2e})")


def _train_parallel(ref: torch.nn.Module, dims, batches: list[torch.Tensor]):
    """(parallel model, its state, optimizer) after STEPS AdamW steps, each checked against `ref` trained on the
    whole batch in this process (`ref` is trained too)."""
    import moeflow
    from moeflow.parallel.grads import clip_grad_norm_

    rank, world = dist.get_rank(), dist.get_world_size()
    state = moeflow.parallelize(copy.deepcopy(ref), dims)
    par = state.model
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, eps=EPS)
    opt_par = torch.optim.AdamW(par.parameters(), lr=1e-3, weight_decay=0.1, eps=EPS)
    # the tp ranks of one data-parallel rank share its rows (tp is the mesh's innermost dim); each then holds the
    # same loss, so the mean over all ranks is the mean over the data-parallel ones
    dp_rank, rows = rank // dims.tp, batches[0].shape[0] // (world // dims.tp)
    for step, ids in enumerate(batches):
        ref_loss = _loss(ref, ids)
        ref_loss.backward()
        par_loss = _loss(par, ids[dp_rank * rows:(dp_rank + 1) * rows])
        par_loss.backward()
        mean = par_loss.detach().clone()
        dist.all_reduce(mean)
        _close(float(mean) / world, ref_loss.item(), f"loss at step {step}")
        want = torch.stack([p.grad.pow(2).sum() for p in ref.parameters() if p.grad is not None]).sum().sqrt()
        _close(float(clip_grad_norm_(par, float("inf"), state)), float(want), f"grad norm at step {step}")
        for opt in (opt_ref, opt_par):
            opt.step()
            opt.zero_grad()
    return par, state, opt_par


def _refusal(folder: Path, **sizes) -> str:
    """The one line moeflow refuses a layout with, before any rank starts ('ok' when it takes it)."""
    from moeflow.config import JobConfig
    from moeflow.core.model_config import ModelConfig

    job = JobConfig(model=ModelConfig(hf_path=str(folder), hf_impl="transformers"))
    for key, value in sizes.items():
        setattr(job.parallel, key, value)
    try:
        job.validate().layout(2)
    except ValueError as e:
        return str(e)
    return "ok"


def cover(arch: str, work: Path) -> dict[str, str]:
    """{capability: 'ok' or why not} for one architecture (collective: every rank calls it)."""
    import moeflow
    from tests.support.hf_tiny import tiny_model

    rank = dist.get_rank()
    cells: dict[str, str] = {}
    folder, run = work / arch / "start", work / arch / "run"
    ref = tiny_model(arch, seed=0)
    vocab = ref.config.get_text_config().vocab_size
    if rank == 0:
        ref.save_pretrained(folder)
    dist.barrier()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (2, S + 1), generator=gen) for _ in range(STEPS)]
    held_out = torch.randint(0, vocab, (2, S + 1), generator=gen)

    _train_parallel(copy.deepcopy(ref), moeflow.ParallelDims(2, zero=3), batches)
    cells["dp=2"] = "ok"
    trained = copy.deepcopy(ref)
    par, _, opt = _train_parallel(trained, moeflow.ParallelDims(2, ep=2, zero=3), batches)
    cells["ep=2"] = "ok"

    cells["read"] = _read_owned(ref, folder, moeflow.ParallelDims(2, ep=2, zero=3))

    _save_run(par, opt, folder, run)
    # one process reads the whole checkpoint, as `moeflow convert` does; the peer waits (a failure here is
    # rank 0's alone, so it travels to the peer as a value rather than leaving it in a collective)
    failure = [None]
    if rank == 0:
        try:
            cells["export"], cells["generate"] = _export_and_generate(trained, run, work / arch / "hf", held_out)
            cells["native"] = _native(ref, folder, held_out)
            cells["lora"] = _lora(ref, folder, work / arch / "adapter", held_out)
        except Exception as e:
            failure[0] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(failure, src=0)
    if failure[0]:
        raise AssertionError(failure[0])
    # the refusals name the folder; the table names the architecture
    cells["tp=2"] = _refusal(folder, tp=2).replace(str(folder), arch)
    if cells["tp=2"] == "ok":  # taken: it must train as one process does (the MoE folded over tp)
        _train_parallel(copy.deepcopy(ref), moeflow.ParallelDims(2, tp=2, zero=3), batches)
    cells["pp=2"] = _refusal(folder, pp=2, pp_schedule="GPipe").replace(str(folder), arch)
    if cells["pp=2"] == "ok":  # taken: two stages (a layer each at least) train as one process does
        _train_pipeline(copy.deepcopy(ref), moeflow.ParallelDims(2, pp=2, pp_schedule="GPipe"), batches)
    cells["cp=2"] = _refusal(folder, cp=2).replace(str(folder), arch)
    if cells["cp=2"] == "ok":  # taken: both ranks' halves of every sequence train as one process does
        _train_context(copy.deepcopy(ref), moeflow.ParallelDims(2, cp=2, zero=3), batches)
    return cells


def _read_owned(ref: torch.nn.Module, folder: Path, dims) -> str:
    """'ok' when each rank's rank-local read of `folder` equals `ref` parallelized, tensor for tensor (bit for bit:
    the same values, copied), and read less than the files hold; a mismatch raises."""
    from torch.distributed.tensor import DTensor

    import moeflow
    from moeflow.models import hf_transformers
    from moeflow.train import hf_sharded_transformers

    whole = moeflow.parallelize(copy.deepcopy(ref), dims).model
    owned = hf_transformers.load_empty(folder)
    moeflow.parallelize(owned, dims)
    read = hf_sharded_transformers.load_owned(owned, folder, torch.device("cpu"))
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t
    want = {**whole.state_dict(), **dict(whole.named_buffers())}
    got = {**owned.state_dict(), **dict(owned.named_buffers())}
    if got.keys() != want.keys():
        raise AssertionError(f"rank-local read: other tensors {sorted(set(got) ^ set(want))[:3]}")
    differ = [k for k in want if not torch.equal(local(got[k]), local(want[k]))]
    if differ:
        raise AssertionError(f"rank-local read: {len(differ)} tensors differ, e.g. {differ[0]}")
    on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    if read >= on_disk:
        raise AssertionError(f"rank-local read: {read} bytes of {on_disk} read")
    return "ok"


def _train_pipeline(ref: torch.nn.Module, dims, batches: list[torch.Tensor], boundaries=None) -> None:
    """STEPS AdamW steps of `ref`'s pipeline stages (each rank its own, both on the whole batch, in 2
    micro-batches; split at `boundaries`, else evenly), each step's loss and gradient norm checked against `ref`
    trained in this process."""
    import moeflow
    from moeflow.parallel.grads import clip_grad_norm_

    # two micro-batches of one row: the stages' boundaries take their shapes from it, as under `moeflow train`
    state = moeflow.parallelize(copy.deepcopy(ref), dims, moeflow.ParallelOptions(
        microbatches=2, pp_microbatch_shape=(1, S), pp_boundaries=boundaries))
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, eps=EPS)
    opt_par = torch.optim.AdamW(state.model.parameters(), lr=1e-3, weight_decay=0.1, eps=EPS)
    for step, ids in enumerate(batches):
        ref_loss = _loss(ref, ids)
        ref_loss.backward()
        loss = state.runner.train_step(ids[:, :-1], ids[:, 1:])
        _close(float(loss), ref_loss.item(), f"pipeline loss at step {step}")
        want = torch.stack([p.grad.pow(2).sum() for p in ref.parameters() if p.grad is not None]).sum().sqrt()
        _close(float(clip_grad_norm_(state.model, float("inf"), state)), float(want), f"grad norm at step {step}")
        for opt in (opt_ref, opt_par):
            opt.step()
            opt.zero_grad()


def _train_context(ref: torch.nn.Module, dims, batches: list[torch.Tensor]) -> None:
    """STEPS AdamW steps with every sequence split over the cp ranks (the runner's default loss scale: cp / the
    targets of the whole sequences), each step's mean loss and gradient norm checked against `ref`."""
    import moeflow
    from moeflow.parallel.grads import clip_grad_norm_

    state = moeflow.parallelize(copy.deepcopy(ref), dims)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, eps=EPS)
    opt_par = torch.optim.AdamW(state.model.parameters(), lr=1e-3, weight_decay=0.1, eps=EPS)
    for step, ids in enumerate(batches):
        ref_loss = _loss(ref, ids)
        ref_loss.backward()
        loss = state.runner.train_step(state.local_sequence(ids[:, :-1]), state.local_sequence(ids[:, 1:]))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        _close(float(mean) / dist.get_world_size(), ref_loss.item(), f"context-parallel loss at step {step}")
        want = torch.stack([p.grad.pow(2).sum() for p in ref.parameters() if p.grad is not None]).sum().sqrt()
        _close(float(clip_grad_norm_(state.model, float("inf"), state)), float(want), f"grad norm at step {step}")
        for opt in (opt_ref, opt_par):
            opt.step()
            opt.zero_grad()


def _save_run(model, optimizer, folder: Path, run: Path) -> None:
    """A run directory as `moeflow train` leaves it: config.toml and a checkpoint written by every rank."""
    from moeflow.config import JobConfig, to_toml
    from moeflow.core.model_config import ModelConfig
    from moeflow.train.checkpoint import CheckpointManager

    job = JobConfig(run_dir=str(run), model=ModelConfig(hf_path=str(folder), hf_impl="transformers")).validate()
    if dist.get_rank() == 0:
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.toml").write_text(to_toml(job))
    CheckpointManager(run, keep=1, rank=dist.get_rank()).save(STEPS, model, optimizer, {"step": STEPS})
    dist.barrier()


def _export_and_generate(trained, run: Path, out: Path, held_out: torch.Tensor) -> tuple[str, str]:
    import transformers

    from moeflow.convert import moeflow_to_hf
    from moeflow.generate import generate, load_model

    moeflow_to_hf(run, out, dtype="fp32")
    # its own class: not every architecture is registered with AutoModelForCausalLM
    exported = type(trained).from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        _close(float(_loss(exported, held_out)), float(_loss(trained.eval(), held_out)), "exported model's loss")
    model, _, _, eos = load_model(str(run))
    prompt = held_out[0, :6].tolist()
    ours = generate(model, prompt, 8, temperature=0.0, eos=eos)  # both stop at the end-of-sequence id
    theirs = exported.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                               pad_token_id=0)[0, 6:].tolist()
    if ours != theirs:
        raise AssertionError(f"greedy tokens: moeflow {ours} vs transformers {theirs}")
    del transformers
    return "ok", "ok"


def _native(ref, folder: Path, held_out: torch.Tensor) -> str:
    from moeflow.models.hf import from_pretrained

    try:
        model, _ = from_pretrained(folder)
    except ValueError as e:
        return str(e)
    with torch.no_grad():
        want = _loss(ref.eval(), held_out)
        got = torch.nn.functional.cross_entropy(model(held_out[:, :-1]).flatten(0, 1), held_out[:, 1:].flatten())
    _close(float(got), float(want), "moeflow's native model's loss")
    return "ok"


def _lora(ref, folder: Path, out: Path, held_out: torch.Tensor) -> str:
    import peft

    from moeflow.config import PeftConfig
    from moeflow.core.model_config import ModelConfig
    from moeflow.models import lora
    from moeflow.models.peft_format import write_adapter
    from tests.support.model_helpers import random_lora_factors

    model = copy.deepcopy(ref).eval()
    lora.add(model, 4, 8.0, 0.0, "auto", True)
    factors = random_lora_factors(model)
    if not any(".experts.lora_" in name for name in factors):
        raise AssertionError("no experts adapter")
    adapter = write_adapter(factors, ModelConfig(hf_path=str(folder), hf_impl="transformers"),
                            PeftConfig(method="lora", rank=4, alpha=8.0), out)
    base = lambda: type(ref).from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        ours = float(_loss(model, held_out))
        theirs = float(_loss(peft.PeftModel.from_pretrained(base(), adapter).eval(), held_out))
        if abs(theirs - float(_loss(ref.eval(), held_out))) < 1e-3:
            raise AssertionError("the adapter does not change the loss")
        _close(float(_loss(lora.merge(model), held_out)), ours, "the merged adapter's loss")
        if abs(theirs - ours) <= REL * abs(ours):
            return "ok"
        # peft's own adapter of the same targets, saved and loaded back
        config = peft.LoraConfig.from_pretrained(str(adapter))
        config.init_lora_weights, config.inference_mode = False, False
        own = peft.get_peft_model(base(), config).eval()
        before = float(_loss(own, held_out))
        own.save_pretrained(str(out.with_name("peft-own")))
        after = float(_loss(peft.PeftModel.from_pretrained(base(), str(out.with_name("peft-own"))).eval(), held_out))
    if abs(after - before) > REL * abs(before):
        return (f"peft {peft.__version__} does not load its own adapter of this architecture back (the loss "
                f"{before:.4f} becomes {after:.4f} through its save_pretrained / from_pretrained)")
    _close(theirs, ours, "PeftModel's loss with moeflow's adapter")
    return "ok"


def run_case(_, case) -> None:
    """dist_harness entry: ('matrix', architectures, out_dir)."""
    _, archs, out = case
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)  # rank 0's scratch folder for everyone (one machine)
        for arch in archs:
            # every rank fails alike (the checks compare all-reduced numbers), so the ranks stay in step and
            # the next architecture runs: one failure does not hide the others
            try:
                results[arch] = cover(arch, Path(shared[0]))
            except Exception as e:
                results[arch] = {"error": f"{type(e).__name__}: {e}"}
            dist.barrier()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))


def matrix(archs: list[str], per_launch: int = 12) -> dict[str, dict[str, str]]:
    """{architecture: cells} over two gloo ranks, `per_launch` architectures per pair of processes: every layout
    keeps its process groups' gloo threads to the end of the process, and dozens of architectures' worth of them
    slow every collective down."""
    from tests.support.dist_harness import check_results, launch

    cells = {}
    with tempfile.TemporaryDirectory() as tmp:
        for start in range(0, len(archs), per_launch):
            cases = [("matrix", archs[start:start + per_launch], f"{tmp}/cells.json")]
            check_results(launch(2, cases, run_case, timeout_s=300), cases)
            cells.update(json.loads(Path(f"{tmp}/cells.json").read_text()))
    return cells


def main(argv: list[str]) -> int:
    import argparse

    from tests.support.hf_tiny import moe_architectures, not_fitting_reason

    p = argparse.ArgumentParser(prog="python -m tests.e2e.hf_coverage")
    p.add_argument("archs", nargs="*")
    p.add_argument("--out", help="write hf_coverage.json here (bench/results for the README)")
    args = p.parse_args(argv)
    found = moe_architectures()
    archs = args.archs or sorted(a for a, cls in found.items() if cls)
    cells = matrix(archs)
    unfit = {a: not_fitting_reason(a) for a, cls in found.items() if not cls and not args.archs}
    for arch, row in sorted(cells.items()):
        print(f"{arch:<24} " + "  ".join(f"{c} {'ok' if row.get(c) == 'ok' else 'no'}" for c in CAPABILITIES))
    for arch, why in sorted(unfit.items()):
        print(f"{arch:<24} not trained: {why}")
    if args.out:
        import transformers

        record = {"transformers": transformers.__version__, "torch": torch.__version__, "capabilities": CAPABILITIES,
                  "cells": cells, "not_fitting": unfit}
        Path(args.out, "hf_coverage.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
