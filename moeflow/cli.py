"""The `moeflow` command: train | generate | eval | plan | simulate | convert | info."""

from __future__ import annotations

import argparse
import os
import sys

USAGE = """moeflow <command> [options]

commands:
  train      train a model (config file + --section.key=value overrides); --help for details
  generate   generate text with a run or a Hugging Face folder (`moeflow generate --help`)
  eval       loss and perplexity of a run or a Hugging Face folder on a file or dataset
  plan       choose a parallel layout for a model on a cluster (memory and time model)
  simulate   predict expert-parallel traffic at scale (`moeflow simulate ep --help`)
  convert    Hugging Face folder <-> moeflow checkpoint (`moeflow convert --help`)
  info       versions, devices and available backends
"""


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moeflow train",
        description="Train a model. Settings come from defaults, then --config FILE (TOML; without it, "
        "RUN_DIR/config.toml when --run-dir holds one), then "
        "--section.key=value overrides (e.g. --training.steps=100 --model.name=tiny-dense). "
        "Training resumes automatically from the newest complete checkpoint in --run-dir.",
        epilog="All settings: moeflow train --help-config. Effective config: --print-config.",
    )
    p.add_argument("--config", help="TOML job file (see configs/)")
    p.add_argument("--run-dir", help="output folder for metrics, TensorBoard and checkpoints (run_dir); when it "
                   "holds a config.toml and --config is not given, that file is the starting point")
    p.add_argument("--resume", action="store_true", help="require a checkpoint to resume from (error if none)")
    p.add_argument("--fresh", action="store_true", help="ignore existing checkpoints in the run dir")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="start this many local processes (through torch.distributed.run); default 1")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="restart every rank up to N times after a rank fails, resuming from the newest complete "
                   "checkpoint (parallel.max_restarts; passed to torch.distributed.run)")
    p.add_argument("--print-config", action="store_true", help="print the effective config as TOML and exit")
    p.add_argument("--help-config", action="store_true", help="list every setting with its type and meaning")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true",
                   help="build the mesh and apply the layout in one process with a fake process group, print "
                   "what each rank would hold (parameters, gradient and optimizer bytes), and exit; no training")
    p.add_argument("--world-size", type=int, default=None,
                   help="with --dry-run: the number of ranks to plan for (default: --nproc-per-node or 1)")
    p.add_argument("--json", action="store_true", help="with --dry-run: print JSON instead of a table")
    p.add_argument("--prepare-data", action="store_true",
                   help="tokenize the dataset into its cache (data.cache_dir) and exit; run it once before a "
                   "torchrun / Slurm launch of a large dataset so no rank waits on the tokenizer")
    return p


def _help_config() -> str:
    from moeflow.config import all_keys
    from moeflow.core.choices import SETTINGS

    lines = []
    for key, (typ, doc) in all_keys().items():
        choices = f"\n      one of: {', '.join(SETTINGS[key])}" if key in SETTINGS else ""
        lines.append(f"  --{key}=<{getattr(typ, '__name__', str(typ))}>\n      {doc}{choices}")
    return ("settings (model.* keys override the preset chosen by model.name; with model.hf_path the folder decides "
            "the architecture):\n" + "\n".join(lines))


def _refuse_what_this_torch_cannot_run(cfg, device: str) -> None:
    """The pipelines moeflow.parallel.torch_compat refuses in every rank, said once here before any process starts."""
    if cfg.parallel.pp <= 1:
        return
    from moeflow.core.schedules import SCHEDULES, resolve_schedule
    from moeflow.parallel.runner import pipeline_counts_first
    from moeflow.parallel.torch_compat import pipeline_refusal

    schedule = resolve_schedule(cfg.parallel.pp_schedule)
    why = pipeline_refusal(schedule, SCHEDULES[schedule].placement == "v", "gloo" if device == "cpu" else "nccl",
                           cfg.model.mtp_depth, pipeline_counts_first(cfg.model))
    if why:
        raise ValueError(why)


def cmd_train(argv: list[str]) -> int:
    parser = _train_parser()
    args, rest = parser.parse_known_args(argv)
    if args.help_config:
        print(_help_config())
        return 0
    from moeflow.config import load_config, load_run_config, parse_overrides, to_toml

    overrides = parse_overrides(rest)
    if args.run_dir:
        overrides["run_dir"] = args.run_dir
    # A run directory continues with the config it was started with, unless --config names another.
    cfg = (load_run_config(args.run_dir, overrides, model_may_change=args.fresh)
           if args.run_dir and not args.config else None)
    if cfg is not None and "LOCAL_RANK" not in os.environ:
        print(f"moeflow train: continuing with {args.run_dir}/config.toml (the run directory's config; "
              f"--config FILE starts from another)", file=sys.stderr)
    cfg = cfg or load_config(args.config, overrides)  # validate before starting any process
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    if args.world_size is not None and not args.dry_run:
        raise ValueError("--world-size is only for --dry-run; to start processes use --nproc-per-node "
                         "(or torchrun for several machines)")
    if args.dry_run:
        import json

        from moeflow.train.dry_run import dry_run, format_dry_run

        world = args.world_size if args.world_size is not None else (args.nproc_per_node or 1)
        out = dry_run(cfg, world)
        print(json.dumps(out, indent=1) if args.json else format_dry_run(out))
        return 0
    from moeflow.train.data_setup import prepare, uses_cache
    from moeflow.train.distributed import choose_device

    nproc = args.nproc_per_node
    max_restarts = cfg.parallel.max_restarts if args.max_restarts is None else args.max_restarts
    if max_restarts < 0:
        raise ValueError(f"--max-restarts {max_restarts}: use 0 (no restarts) or more")
    launching = ((nproc and nproc > 1) or max_restarts > 0) and "LOCAL_RANK" not in os.environ
    if launching:
        cfg.layout(nproc or 1)  # a bad layout is one line here, not an error in every rank
        device = choose_device(cfg.training.device, nproc or 1)  # 'cuda' without a GPU per process: one line here
        _refuse_what_this_torch_cannot_run(cfg, device)
    if args.prepare_data and not uses_cache(cfg):
        print(f"data.source = {cfg.data.source!r} is read directly (no token cache to prepare)", file=sys.stderr)
        return 0
    if args.prepare_data or (launching and uses_cache(cfg)):
        # One process tokenizes (bad records are one line here), before any rank or process group exists.
        print(f"data cache: {prepare(cfg)}", file=sys.stderr)
        if args.prepare_data:
            return 0
    if launching:
        return _launch(nproc or 1, argv, cfg.run_dir, max_restarts)
    from moeflow.train.faults import exit_code
    from moeflow.train.trainer import train

    # A restart by torch.distributed.run resumes, whatever --fresh said on the first start.
    fresh = args.fresh and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    try:
        summary = train(cfg, resume=args.resume, fresh=fresh, progress=not args.no_progress)
    except Exception as e:  # a stop signal, an unwritable disk, a failed peer: one line and a documented code
        code = exit_code(e, cfg.run_dir)
        if code is None:
            raise
        return code
    if int(os.environ.get("RANK", "0")) == 0:
        print(format_summary(summary))
    _destroy()
    return 0


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        # Every rank done with its last collective before any tears its groups down: a rank that destroys its
        # gloo groups while a slower peer still talks to it can abort ("terminate called without an active
        # exception", rare with gloo).
        dist.barrier()
        dist.destroy_process_group()


def _launch(nproc: int, argv: list[str], run_dir: str, max_restarts: int) -> int:
    """Re-run this command under torch.distributed.run with nproc local processes (moeflow/train/launch.py)."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--nproc-per-node", "--max-restarts"):
            skip = True
        elif not a.startswith(("--nproc-per-node=", "--max-restarts=")):
            rest.append(a)
    from moeflow.train.launch import launch

    return launch(nproc, rest, run_dir, max_restarts)


def format_summary(s: dict) -> str:
    def fmt(x, spec=".4f"):
        return "n/a" if x is None else format(x, spec)

    rows = [
        ("model", f"{s['model']} ({s['params'] / 1e6:.2f}M params, {s['active_params'] / 1e6:.2f}M active)"),
        ("layout", s["layout"]),
        ("steps", f"{s['start_step']} -> {s['steps']} in {s['elapsed_s']:.1f} s"),
        ("train loss", f"{fmt(s['first_loss'])} -> {fmt(s['final_loss'])}"),
        ("val loss", fmt(s["val_loss"])),
        ("tokens/s", f"{s['tokens_per_s']:,.0f}" + ("  (MFU unknown: no peak FLOP/s for this device)"
                                                    if s.get("mfu") == "unknown" else "")),
        *([("data", _data_line(s["data"]))] if s.get("data") else []),
        ("checkpoint", s["checkpoint"] or "none"),
        *([("adapter", _adapter_line(s["adapter"]))] if s.get("adapter") else []),
        *([("hf folder", s["hf"])] if s.get("hf") else []),
        *([("loss curve", s["loss_curve"])] if s.get("loss_curve") else []),
        ("metrics", f"{s['metrics']}  (TensorBoard: tensorboard --logdir {s['tensorboard']})"),
    ]
    return "\nsummary\n" + "\n".join(f"  {k:<11} {v}" for k, v in rows)


def _adapter_line(a: dict) -> str:
    """'runs/x/adapter (LoRA r=8, 0.05M trained params, 0.2 MB, PEFT's format)'."""
    return (f"{a['path']} (LoRA r={a['rank']}, {a['trained_params'] / 1e6:.2f}M trained params, "
            f"{a['bytes'] / 2**20:.1f} MB, PEFT's format)")


def _data_line(d: dict) -> str:
    """'chat, 120 records -> 37 packed rows (83% full), 2 truncated' (token cache runs); for a blend, each source's
    weight and trained tokens."""
    if "sources" in d:
        total = sum(src["trained_tokens"] for src in d["sources"]) or 1
        return "blend: " + "; ".join(f"{src['name']} {src['weight']:.2f} (trained {src['trained_tokens']:,} tokens, "
                                     f"{src['trained_tokens'] / total:.1%})" for src in d["sources"])
    if d.get("streaming"):
        return f"text, streamed from {d['source']} (epoch {d['epoch']}, next window in record {d['next_record']:,})"
    line = f"{d['format']}, {d['records']:,} records"
    if "rows" in d:
        line += f" -> {d['rows']:,} {'packed ' if d['packing'] else ''}rows ({d['fill']:.0%} full)"
    extra = [f"{d[k]} {k}" for k in ("truncated", "dropped") if d.get(k)]
    return line + (", " + ", ".join(extra) if extra else "")


def cmd_info(argv: list[str]) -> int:
    import platform

    import torch
    import torch.distributed as dist

    import moeflow

    print(f"moeflow {moeflow.__version__}, torch {torch.__version__}, Python {platform.python_version()}")
    print(f"platform: {platform.platform()}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads")
    if torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else "not built"
        print(f"CUDA {torch.version.cuda}, NCCL {nccl}")
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            # torch's fast grouped GEMM (the MoE experts' path) is bf16 on sm90 / sm100; elsewhere a per-group fallback
            fast = "yes" if props.major in (9, 10) else "no (per-group fallback)"
            print(f"cuda:{i}: {props.name}, sm{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
                  f"bf16 grouped GEMM fast path: {fast}")
    else:
        print("CUDA: not available (training runs on the CPU with gloo)")
    backends = [b for b, ok in [("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                ("mpi", dist.is_mpi_available())] if ok]
    print(f"torch.distributed backends: {', '.join(backends) or 'none'}")
    for pkg in ("transformers", "deep_ep", "uccl", "safetensors", "tokenizers"):
        try:
            mod = __import__(pkg)
            print(f"{pkg}: {getattr(mod, '__version__', 'installed')}")
        except ImportError:
            print(f"{pkg}: not installed")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "train":
            return cmd_train(rest)
        if cmd == "info":
            return cmd_info(rest)
        if cmd == "generate":
            from moeflow.generate import main as generate_main

            return generate_main(rest)
        if cmd == "eval":
            from moeflow.evaluate import main as eval_main

            return eval_main(rest)
        if cmd == "plan":
            from moeflow.plan.cli import main as plan_main

            return plan_main(rest)
        if cmd == "simulate":
            from moeflow.sim.cli import main as sim_main

            return sim_main(rest)
        if cmd == "convert":
            from moeflow.convert import main as convert_main

            return convert_main(rest)
    except ValueError as e:
        # Bad input: one clear line, no traceback.
        print(f"moeflow {cmd}: error: {e}", file=sys.stderr)
        return 2
    print(f"moeflow: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
