"""parallel.offload = 'optimizer': ZeRO-Offload's optimizer half (Ren et al. 2021) - the weights and gradients stay
on the device, the optimizer's state and its elementwise update live in host memory.

Per trainable parameter (its local shard under FSDP2 / TP / EP) the host keeps a gradient buffer and the
optimizer's state (pinned where a GPU copies to and from them). AdamW: an fp32 master copy and its two moments, 16
bytes per parameter on the host and 8 fewer on the device than AdamW there; a step copies each gradient shard to
the host, runs torch's own AdamW update (`torch.optim.adam.adam` with decoupled weight decay, multi-tensor, as
torch.optim.AdamW runs it) on the host tensors, and copies the master copies back onto the device shards: 4
bytes per parameter each way per step, against parallel.offload = 'params', which moves the weights per
micro-batch. Muon (moeflow/train/muon.py): its momentum, 8 bytes per parameter on the host with the gradient
buffer; the momentum update runs there and the update matrix goes back to the device, where Newton-Schulz and
the weight update run (4 bytes each way as well).

The state tensors are DTensors where the parameter is one (same mesh and placements, host local tensors, as FSDP2's
own CPU offload keeps its shards), so checkpoints store them by global shape and reshard; a checkpoint loads them
into host tensors (`state_like`; moeflow/train/state_dict.py), and a state that arrives on the device anyway (an
expert's, resharded) moves to the host at the next step. The master copies are not state: they equal the (fp32)
weights, and are taken from them at the first step after the optimizer is built or a state is loaded (a new
state dict for the parameter).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

HOST = torch.device("cpu")


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def placed_as(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a tensor shaped as p's shard, on any device) as p is: a DTensor over p's mesh where p is one."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return local


def _pinned(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(like.shape, dtype=torch.float32, device=HOST, pin_memory=torch.cuda.is_available())


class HostState:
    """The host half of an optimizer that keeps its state in host memory: its state tensors, gradient buffers and
    master copies there, and AdamW's step on them (HostOffloadAdamW, and Muon's AdamW groups)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        # parameter -> (the state dict its master belongs to, its fp32 shard on the host): a loaded state is a new
        # dict (load_state_dict, moeflow.train.state_dict.apply), after which the master is taken again
        self._masters: dict[torch.Tensor, tuple[dict, torch.Tensor]] = {}
        self._grads: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> the host buffer of its gradient shard

    def state_like(self, p: torch.Tensor) -> torch.Tensor:
        """An uninitialised host tensor shaped as p's state (what a checkpoint's is loaded into)."""
        return placed_as(p, torch.empty(local_of(p).shape, dtype=torch.float32, device=HOST))

    def state(self, p: torch.Tensor, keys: tuple[str, ...], with_step: bool) -> dict:
        """p's state on the host: `keys` created zero (and a step count), or moved there once after a load."""
        state = self.optimizer.state[p]
        if not state:
            if with_step:
                state["step"] = torch.tensor(0.0, device=HOST)
            for key in keys:
                state[key] = placed_as(p, torch.zeros_like(local_of(p), dtype=torch.float32, device=HOST))
        for key in keys:
            if local_of(state[key]).device != HOST:  # loaded onto the parameter's device (an expert's, resharded)
                host = self.state_like(p)
                local_of(host).copy_(local_of(state[key]))
                state[key] = host
        if with_step:
            state["step"] = state["step"].to(HOST, torch.float32)
        return state

    def copy_grads(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradient shards of `params` in their host buffers (as the parameters are: DTensors where they are),
        every copy landed."""
        out = []
        for p in params:
            if p not in self._grads:
                self._grads[p] = _pinned(local_of(p))
            self._grads[p].copy_(local_of(p.grad), non_blocking=True)
            out.append(placed_as(p, self._grads[p]))
        if out and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # every gradient's copy has landed (one wait per call)
        return out

    def adamw(self, groups: list[dict]) -> None:
        """AdamW's step for `groups` on the host: gradients down (one wait for all), the update on fp32 masters,
        the weights back."""
        stepped = [(group, [p for p in group["params"] if p.grad is not None]) for group in groups]
        copied = iter(self.copy_grads([p for _, params in stepped for p in params]))
        for group, params in stepped:
            if not params:
                continue
            grads = [local_of(next(copied)) for _ in params]
            masters, exp_avgs, exp_avg_sqs, steps = [], [], [], []
            for p in params:
                state = self.state(p, ("exp_avg", "exp_avg_sq"), with_step=True)
                if p not in self._masters or self._masters[p][0] is not state:
                    self._masters[p] = (state, _pinned(local_of(p)))
                    self._masters[p][1].copy_(local_of(p))
                masters.append(self._masters[p][1])
                exp_avgs.append(local_of(state["exp_avg"]))
                exp_avg_sqs.append(local_of(state["exp_avg_sq"]))
                steps.append(state["step"])
            beta1, beta2 = group["betas"]
            adam(masters, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True, amsgrad=group.get("amsgrad", False),
                 beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group.get("maximize", False), decoupled_weight_decay=True)
            for p in params:
                local_of(p).copy_(self._masters[p][1], non_blocking=True)


class HostOffloadAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (the same arguments, param groups, state names and update) whose state and update are in
    host memory."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.host = HostState(self)

    def state_like(self, p: torch.Tensor) -> torch.Tensor:
        return self.host.state_like(p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.host.adamw(self.param_groups)
        return loss
