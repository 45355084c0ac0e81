"""Muon (Jordan et al. 2024; the recipe Moonlight and Kimi K2 trained with) beside AdamW, in one optimizer.

Muon updates each hidden weight matrix by the orthogonalised momentum: B <- mu B + (1 - mu) G (torch's
`lerp`), the update U = G + mu (B - G) with Nesterov (else B), O = NS_k(U) (k Newton-Schulz iterations with the
coefficients (a, b, c), the matrix first scaled to spectral norm <= 1, the short side first), then
W <- W (1 - lr wd) - lr' O with lr' = lr x 0.2 sqrt(max(A, B)) ('match_rms_adamw', Moonlight: the update's RMS
then matches AdamW's, so AdamW's learning rate carries over) or lr x sqrt(max(1, A / B)) ('original'). This is
torch.optim.Muon's update (torch 2.13, 2-D parameters only), which the tests hold it to; here a 3-D experts tensor
[E, A, B] is E matrices, each orthogonalised on its own.

Which parameters: Muon takes every matrix of the blocks (attention and MLP projections, the experts, MLA's
low-rank projections); AdamW (`torch.optim.adam.adam`, decoupled weight decay: torch.optim.AdamW's update and state
names) keeps the embedding, the output head, norms, biases, the routers' gates and anything 1-D, with its own
learning rate (training.muon_adamw_lr, default training.lr).

Sharded layouts (FSDP2, ZeRO-1, tp, efsdp): Newton-Schulz needs each whole matrix, so each matrix of a sharded
update is orthogonalised by one rank of its mesh and the results come back to the shards: for updates cut over one
mesh dim by two all-to-alls (`_ShardedMatrices`: the shards to each matrix's owner, its result's pieces back;
under HSDP each replica a share of the matrices, the results summed over the replicas), for those cut over several
by a gather and a sum (`_orthogonalised`); the updates a rank holds whole are
orthogonalised stacked by shape (`_LocalMatrices`).

ZeRO-Offload (parallel.offload): under 'optimizer' the momentum, a gradient buffer and the AdamW groups' state
live in host memory (`on_host`, moeflow/train/offload.py); under 'params' FSDP2 keeps the shards, their gradients
and so the momentum there. Either way the momentum update runs on the host and each update matrix goes to the
accelerator for Newton-Schulz and its collectives (`compute_device`): the host's cores would take seconds per
step over the matrices' five matmuls per iteration.
docs/design.md, "Optimizers"; its cost per layout: moeflow.plan.optimizer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeflow.train.offload import HostState, local_of, placed_as

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's (torch.optim.Muon's defaults)
NS_EPS = 1e-7


def muon_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon's, AdamW's) trainable parameters, by what they are (module docstring), in a moeflow model or in
    transformers' own modules."""
    from moeflow.models.moe import Router

    adamw_ids = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding) or isinstance(module, Router):
            adamw_ids |= {id(p) for p in module.parameters()}
    head = getattr(model, "output", None)
    if hasattr(model, "get_output_embeddings"):  # transformers' lm_head
        head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        adamw_ids |= {id(p) for p in head.parameters()}  # its weight, and a LoRA's factors on it
    adamw_ids |= _hf_router_parameters(model)
    muon, adamw = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (muon if p.ndim >= 2 and id(p) not in adamw_ids else adamw).append(p)
    return muon, adamw


def _hf_router_parameters(model: nn.Module) -> set[int]:
    """ids of what AdamW keeps in transformers' MoE blocks: beside each experts module, the modules whose every
    matrix has one row per expert or a single row (the router, a shared expert's scalar gate); inside it, what
    is not one matrix per expert (per-expert biases [E, F], 2-D)."""
    from moeflow.parallel.hf_experts import global_num_experts, is_hf_experts

    ids: set[int] = set()
    for block in model.modules():
        for experts in [m for m in block.children() if is_hf_experts(m)]:
            ids |= {id(p) for p in experts.parameters() if p.ndim != 3}
            rows = {1, global_num_experts(experts)}  # the router's rows: every expert, on every rank
            for other in block.children():
                base = [p for name, p in other.named_parameters() if "lora_" not in name]  # (a LoRA's factors follow)
                if other is not experts and base and all(p.ndim < 2 or p.shape[0] in rows for p in base):
                    ids |= {id(p) for p in other.parameters()}
    return ids


def newton_schulz(update: torch.Tensor, steps: int, coefficients=NS_COEFFICIENTS, eps: float = NS_EPS,
                  dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The orthogonalised [A, B] matrix, or each of a stack [N, A, B] (one batched chain of matmuls: a stack of
    small matrices costs a fraction of one call per matrix), computed in `dtype` (bf16, as torch.optim.Muon)."""
    a, b, c = coefficients
    x = update.to(dtype)
    x = x.unsqueeze(0) if x.ndim == 2 else x
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    x = x.mT if tall else x
    return x.squeeze(0) if update.ndim == 2 else x


def compute_device(p: torch.Tensor) -> torch.device:
    """Where p's update is orthogonalised: its mesh's device for a DTensor (the accelerator, also when FSDP2 keeps
    the shard in host memory), else p's own."""
    from torch.distributed.tensor import DTensor

    return torch.device(p.device_mesh.device_type) if isinstance(p, DTensor) else p.device


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device` (a DTensor's shard moved, its mesh and placements kept); t itself where it is there."""
    return t if local_of(t).device.type == device.type else placed_as(t, local_of(t).to(device))


def _orthogonalised(update: torch.Tensor, steps: int, turn: int) -> tuple[torch.Tensor, int]:
    """(NS of each matrix of a sharded `update` (a DTensor: FSDP2, TP), laid out and sharded as `update`; the next
    turn). The update is gathered whole on every rank of its mesh; matrix i is orthogonalised by the mesh's rank
    turn + i (mod its size) alone (this rank's share in one batched call), the others contribute zeros, and a sum
    over the mesh's dims gives every rank every result, which each cuts back to its shard. No matrix is
    orthogonalised twice."""
    from torch.distributed.tensor import distribute_tensor

    mesh = update.device_mesh
    matrices = update.full_tensor()
    matrices = matrices.reshape(-1, *matrices.shape[-2:])  # experts: E matrices
    me = mesh.mesh.flatten().tolist().index(torch.distributed.get_rank()) if mesh.size() > 1 else 0
    mine = [i for i in range(len(matrices)) if (turn + i) % mesh.size() == me]
    out = torch.zeros(matrices.shape, dtype=torch.bfloat16, device=matrices.device)
    if mine:
        out[mine] = newton_schulz(matrices[mine], steps)
    if mesh.size() > 1:
        for dim in range(mesh.ndim):
            torch.distributed.all_reduce(out, group=mesh.get_group(dim))
    out = distribute_tensor(out.view(update.shape), mesh, update.placements, src_data_rank=None)
    return out, turn + len(matrices)


class _ShardedMatrices:
    """Updates cut over one mesh dim (FSDP2's Shard(0), TP's column / row shards), orthogonalised together.
    Matrix i of the pending updates belongs to rank (turn + i) mod n: one all-to-all sends each rank's fp32 shard
    of it there, the owner orthogonalises its matrices (stacked by shape, one batched Newton-Schulz per shape),
    and a second all-to-all sends each rank its piece of every bf16 result. HSDP's replicas (mesh dims that
    replicate the update) each take matrices (t // n) mod r = their index, and one sum over them completes every
    rank's results. A 3-D experts tensor cut along E
    (between its matrices) is orthogonalised where it lies. Two collectives per flush, each matrix moved to one
    rank and back (the scheme bench/optim.py chose over `_gather_and_sum`, which moves it to every rank and sums
    the results: SCHEME). One bucket per (mesh, dim) - expert slices over efsdp and the rest over dp_shard
    interleave layer by layer, and each bucket still fills one collective - flushed once `PENDING_BYTES` of
    whole updates wait in it, and all at the end of the step."""

    PENDING_BYTES = 64 * 2**20
    SCHEME = "all_to_all"  # or "gather_and_sum" (docs/design.md, "Optimizers": chosen by bench/optim.py)

    def __init__(self, steps: int, apply):
        self.steps, self.apply = steps, apply
        # (mesh, dim) -> [(parameter, update, its first turn)], and the whole updates' bytes waiting in it
        self.buckets: dict[tuple, list[tuple[nn.Parameter, torch.Tensor, int]]] = {}
        self.bytes: dict[tuple, int] = {}

    @staticmethod
    def sharded_dim(update: torch.Tensor) -> int | None:
        """The mesh dim an update is cut over when it is the only one of its mesh larger than 1 that cuts it, in
        one Shard, and the others replicate it (the tp dim of a tp-only run, FSDP2's dim of a dp-only or HSDP
        one); None otherwise."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not isinstance(update, DTensor):
            return None
        mesh = update.device_mesh
        sized = [i for i in range(mesh.ndim) if mesh.size(i) > 1]
        cut = [i for i in sized if type(update.placements[i]) is Shard]
        if len(cut) != 1 or not all(isinstance(update.placements[i], Replicate) for i in sized if i != cut[0]):
            return None
        return cut[0]

    def add(self, p: nn.Parameter, update: torch.Tensor, turn: int) -> None:
        key = (update.device_mesh, self.sharded_dim(update))
        self.buckets.setdefault(key, []).append((p, update, turn))
        self.bytes[key] = self.bytes.get(key, 0) + update.numel() * update.element_size()
        if self.bytes[key] >= self.PENDING_BYTES:
            self._flush(key)

    def flush(self) -> None:
        """Every bucket, in the order they were opened (the same on every rank: the parameters' order)."""
        for key in list(self.buckets):
            self._flush(key)

    def _flush(self, key: tuple) -> None:
        pending = self.buckets.pop(key)
        del self.bytes[key]
        (self._all_to_all if self.SCHEME == "all_to_all" else self._gather_and_sum)(pending, *key)

    def _all_to_all(self, pending: list, mesh, k: int) -> None:
        """Each matrix whole on one rank, and its result back to the shards, in two all-to-alls (class doc)."""
        from torch.distributed.tensor import DTensor, Shard

        n, me = mesh.size(k), mesh.get_local_rank(k)
        group = mesh.get_group(k)
        # HSDP's replicas hold the same shards: replica r of nr takes the matrices t with (t // n) mod nr = r, and a
        # sum over the replica dims gives every replica every result
        replicas = [d for d in range(mesh.ndim) if d != k and mesh.size(d) > 1]
        nr, rep = math.prod(mesh.size(d) for d in replicas), 0
        for d in replicas:
            rep = rep * mesh.size(d) + mesh.get_local_rank(d)
        # per update: its local matrices, the matrix dim its cut falls on (None: the cut is between matrices, so
        # this rank holds its matrices whole) and every rank's (length, offset) along that dim
        cuts = []
        for _, u, _ in pending:
            d = u.placements[k].dim % u.ndim
            shard = u.to_local()
            local = shard.reshape(math.prod(shard.shape[:-2]), *shard.shape[-2:])  # (an empty shard: 0 rows)
            if d < u.ndim - 2:
                cuts.append((local, None, None))
            else:
                cuts.append((local, d - (u.ndim - 2), [Shard.local_shard_size_and_offset(u.shape[d], n, r)
                                                         for r in range(n)]))

        def piece(matrix: torch.Tensor, md: int, spans, r: int) -> torch.Tensor:
            return matrix.narrow(md, spans[r][1], spans[r][0])

        # (update, matrix) pairs cut across ranks that this replica orthogonalises, each with its owner: rank
        # (turn + i) mod n
        cut = [(j, i, (turn + i) % n) for j, (_, u, turn) in enumerate(pending) if cuts[j][1] is not None
               for i in range(u.shape[:-2].numel()) if (turn + i) // n % nr == rep]
        mine = [(j, i) for j, i, owner in cut if owner == me]

        def piece_shape(j: int, r: int) -> list[int]:
            local, md, spans = cuts[j]
            shape = list(pending[j][1].shape[-2:])
            shape[md] = spans[r][0]
            return shape

        wholes = {}
        if cut:  # every shard to its matrix's owner
            send = [[cuts[j][0][i].reshape(-1) for j, i, owner in cut if owner == r] for r in range(n)]
            sizes_in = [sum(t.numel() for t in ts) for ts in send]
            sizes_out = [sum(math.prod(piece_shape(j, r)) for j, _ in mine) for r in range(n)]
            dtype = pending[0][1].dtype
            received = torch.empty(sum(sizes_out), dtype=dtype, device=cuts[0][0].device)
            sent = torch.cat([t for ts in send for t in ts]).to(dtype) if sum(sizes_in) else received.new_empty(0)
            torch.distributed.all_to_all_single(received, sent, sizes_out, sizes_in, group=group)
            pieces, start = {}, 0
            for r in range(n):
                for j, i in mine:
                    size = math.prod(piece_shape(j, r))
                    pieces.setdefault((j, i), []).append(received[start:start + size].view(piece_shape(j, r)))
                    start += size
            wholes = {ji: torch.cat(ps, dim=cuts[ji[0]][1]) for ji, ps in pieces.items()}
        # Newton-Schulz on every matrix this rank holds whole or owns, stacked by shape
        held = {j: [m for m in range(len(local)) if m % nr == rep] for j, (local, md, _) in enumerate(cuts)
                if md is None}  # the matrices held whole that this replica orthogonalises
        todo = [((j, None), cuts[j][0][rows]) for j, rows in held.items() if rows]
        todo += [((j, i), m.unsqueeze(0)) for (j, i), m in wholes.items()]
        by_shape: dict[torch.Size, list] = {}
        for key, stack in todo:
            by_shape.setdefault(stack.shape[-2:], []).append((key, stack))
        results = {}
        for group_ in by_shape.values():
            done = newton_schulz(torch.cat([stack for _, stack in group_]), self.steps).to(torch.bfloat16)
            for (key, _), out in zip(group_, done.split([len(stack) for _, stack in group_])):
                results[key] = out
        received = None
        if cut:  # every result's pieces back to their ranks
            back = [[piece(results[(j, i)][0], cuts[j][1], cuts[j][2], r).reshape(-1) for j, i in mine]
                    for r in range(n)]
            sizes_in = [sum(t.numel() for t in ts) for ts in back]
            sizes_out = [sum(math.prod(piece_shape(j, me)) for j, _, owner in cut if owner == r) for r in range(n)]
            received = torch.empty(sum(sizes_out), dtype=torch.bfloat16, device=cuts[0][0].device)
            sent = (torch.cat([t for ts in back for t in ts]) if sum(sizes_in)
                    else received.new_empty(0))
            torch.distributed.all_to_all_single(received, sent, sizes_out, sizes_in, group=group)
        outs, start = {}, 0
        for r in range(n):
            for j, i, owner in cut:
                if owner == r:
                    size = math.prod(piece_shape(j, me))
                    outs.setdefault(j, {})[i] = received[start:start + size].view(piece_shape(j, me))
                    start += size
        done = []  # per update, its local results (zeros where another replica orthogonalised)
        for j, (local, md, _) in enumerate(cuts):
            out = torch.zeros(local.shape, dtype=torch.bfloat16, device=local.device)
            if md is None and held[j]:
                out[held[j]] = results[(j, None)]
            for i, result in outs.get(j, {}).items():
                out[i] = result
            done.append(out)
        if nr > 1:
            summed = torch.cat([o.reshape(-1) for o in done])
            for d in replicas:
                torch.distributed.all_reduce(summed, group=mesh.get_group(d))
            done = [t.view(o.shape) for t, o in zip(summed.split([o.numel() for o in done]), done)]
        for (p, u, _), mine_local in zip(pending, done):
            ortho = DTensor.from_local(mine_local.view(u.to_local().shape), mesh, u.placements, run_check=False,
                                       shape=u.shape, stride=u.stride())
            self.apply(p, ortho)

    def _gather_and_sum(self, pending: list, mesh, k: int) -> None:
        """Every shard to every rank in one all-gather, matrix i orthogonalised by rank (turn + i) mod n alone,
        the results summed in one all-reduce (the scheme bench/optim.py measures all-to-all against)."""
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.tensor import DTensor, Shard

        n, me = mesh.size(k), mesh.get_local_rank(k)
        dims = [u.placements[k].dim % u.ndim for _, u, _ in pending]
        # every rank's slot for an update holds its largest chunk: equal sizes for the one all-gather
        slots = [-(-u.shape[d] // n) * u.numel() // u.shape[d] for (_, u, _), d in zip(pending, dims)]
        local = torch.cat([torch.cat([u.to_local().reshape(-1), u.to_local().new_zeros(slot - u.to_local().numel())])
                           for (_, u, _), slot in zip(pending, slots)])
        gathered = funcol.all_gather_tensor(local, 0, (mesh, k)).view(n, -1)
        mine: dict[torch.Size, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # shape -> (result slot, matrix)
        outs, start = [], 0
        for (_, u, turn), d, slot in zip(pending, dims, slots):
            pieces = []
            for r in range(n):
                shape = list(u.shape)
                shape[d] = Shard.local_shard_size_and_offset(u.shape[d], n, r)[0]
                pieces.append(gathered[r, start:start + slot][:math.prod(shape)].view(shape))
            start += slot
            matrices = torch.cat(pieces, dim=d).reshape(-1, *u.shape[-2:])
            out = torch.zeros(matrices.shape, dtype=torch.bfloat16, device=matrices.device)
            for i, m in enumerate(matrices):
                if (turn + i) % n == me:
                    mine.setdefault(m.shape, []).append((out[i], m))
            outs.append(out)
        for pairs in mine.values():
            done = newton_schulz(torch.stack([m for _, m in pairs]), self.steps)
            for (slot_, _), o in zip(pairs, done):
                slot_.copy_(o)
        summed = torch.cat([o.reshape(-1) for o in outs])
        torch.distributed.all_reduce(summed, group=mesh.get_group(k))
        offset = 0
        for (p, u, _), d, out in zip(pending, dims, outs):
            whole = summed[offset:offset + out.numel()].view(u.shape)
            offset += out.numel()
            length, first = Shard.local_shard_size_and_offset(u.shape[d], n, me)
            ortho = DTensor.from_local(whole.narrow(d, first, length), mesh, u.placements, run_check=False,
                                       shape=u.shape, stride=u.stride())
            self.apply(p, ortho)


class _LocalMatrices:
    """Updates this rank holds whole (one process, expert slices, a mesh of 1), orthogonalised together: stacked by
    matrix shape, one batched Newton-Schulz per shape (a model's many small matrices cost a fraction of one call
    each). Flushed once `PENDING_BYTES` of updates wait, so the step's extra memory stays bounded."""

    PENDING_BYTES = 64 * 2**20

    def __init__(self, steps: int, apply):
        self.steps, self.apply = steps, apply
        self.pending: list[tuple[nn.Parameter, torch.Tensor]] = []
        self.bytes = 0

    def add(self, p: nn.Parameter, update: torch.Tensor) -> None:
        self.pending.append((p, update))
        self.bytes += update.numel() * update.element_size()
        if self.bytes >= self.PENDING_BYTES:
            self.flush()

    def flush(self) -> None:
        by_shape: dict[torch.Size, list[torch.Tensor]] = {}
        for _, update in self.pending:
            by_shape.setdefault(update.shape[-2:], []).append(update.reshape(-1, *update.shape[-2:]))
        done = {shape: iter(newton_schulz(torch.cat(stack), self.steps).split([m.size(0) for m in stack]))
                for shape, stack in by_shape.items()}
        for p, update in self.pending:
            self.apply(p, next(done[update.shape[-2:]]).view(update.shape))
        self.pending, self.bytes = [], 0


def adjusted_lr(lr: float, adjust: str, shape: torch.Size) -> float:
    A, B = shape
    return lr * (0.2 * math.sqrt(max(A, B)) if adjust == "match_rms_adamw" else math.sqrt(max(1, A / B)))


class Muon(torch.optim.Optimizer):
    """Muon for the groups with `muon=True`, AdamW for the others (module docstring)."""

    def __init__(self, muon_params, adamw_params, *, lr: float, adamw_lr: float, weight_decay: float,
                 betas: tuple[float, float], momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 adjust_lr: str = "match_rms_adamw", eps: float = 1e-8, on_host: bool = False):
        groups = [{"params": list(muon_params), "muon": True, "lr": lr, "weight_decay": weight_decay}]
        decay = [p for p in adamw_params if p.ndim >= 2]
        no_decay = [p for p in adamw_params if p.ndim < 2]
        groups += [{"params": decay, "muon": False, "lr": adamw_lr, "weight_decay": weight_decay},
                   {"params": no_decay, "muon": False, "lr": adamw_lr, "weight_decay": 0.0}]
        super().__init__([g for g in groups if g["params"]],
                         dict(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, adjust_lr=adjust_lr,
                              betas=betas, eps=eps))
        # on_host: the state in host memory (parallel.offload = 'optimizer', moeflow/train/offload.py)
        self.host = HostState(self) if on_host else None

    def state_like(self, p: torch.Tensor) -> torch.Tensor:
        """What p's state is loaded into (moeflow/train/state_dict.py): a host tensor where the state lives there."""
        return self.host.state_like(p) if self.host else p.data

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
            elif not self.host:
                self._adamw_step(group)
        if self.host:  # every AdamW group's gradients down in one wait
            self.host.adamw([group for group in self.param_groups if not group["muon"]])

    def _muon_step(self, group: dict) -> None:
        from torch.distributed.tensor import DTensor

        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]

        def apply(p: nn.Parameter, ortho: torch.Tensor) -> None:
            # shard on shard (ortho is laid out as p, or is the local tensor of a p held whole), on p's device
            target = local_of(p)
            target.mul_(1 - lr * wd)
            target.add_(local_of(ortho).to(target.device, target.dtype),
                        alpha=-adjusted_lr(lr, group["adjust_lr"], p.shape[-2:]))

        local = _LocalMatrices(group["ns_steps"], apply)
        sharded = _ShardedMatrices(group["ns_steps"], apply)
        turn = 0  # matrices orthogonalised so far this step: the owner of the next is turn mod the mesh's size
        params = [p for p in group["params"] if p.grad is not None]
        grads = self.host.copy_grads(params) if self.host else [p.grad for p in params]
        for p, grad in zip(params, grads):
            if self.host:
                buf = self.host.state(p, ("momentum_buffer",), with_step=False)["momentum_buffer"]
            else:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                buf = self.state[p]["momentum_buffer"]
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            # Newton-Schulz on the accelerator also where the state (offload = 'optimizer') or the shards
            # themselves (offload = 'params': FSDP2 keeps them on the host) live in host memory
            update = _on(update, compute_device(p))
            if _ShardedMatrices.sharded_dim(update) is not None:
                sharded.add(p, update, turn)
                turn += update.shape[:-2].numel()
            elif isinstance(update, DTensor) and update.device_mesh.size() > 1:
                # cut over several mesh dims (HSDP, FSDP over TP): one tensor at a time
                ortho, turn = _orthogonalised(update, group["ns_steps"], turn)
                apply(p, ortho)
            else:  # held whole here: one process, expert slices, FSDP2's or TP's mesh of 1
                local.add(p, update.to_local() if isinstance(update, DTensor) else update)
                turn += update.shape[:-2].numel()
        sharded.flush()
        local.flush()

    def _adamw_step(self, group: dict) -> None:
        from torch.optim.adam import adam

        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state[p]:
                self.state[p] = {"step": torch.tensor(0.0, device="cpu"), "exp_avg": torch.zeros_like(p),
                                 "exp_avg_sq": torch.zeros_like(p)}
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
             [], [s["step"] for s in states], foreach=False, amsgrad=False, beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
             decoupled_weight_decay=True)
