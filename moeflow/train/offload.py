"""parallel.offload = 'optimizer': ZeRO-Offload's optimizer half (Ren et al. 2021) - the weights and gradients stay
on the device, AdamW's state and its update live in host memory.

Per trainable parameter (its local shard under FSDP2 / TP / EP) the host keeps an fp32 master copy, AdamW's two
moments and a gradient buffer (the master and the buffer pinned where a GPU copies to and from them): 16 bytes
per parameter on the host and 8 fewer on the device than AdamW there. A step copies each gradient shard to the
host, runs torch's own AdamW update (`torch.optim.adam.adam` with decoupled weight decay, multi-tensor, as
torch.optim.AdamW runs it) on the host tensors, and copies the master copies back onto the device shards: 4
bytes per parameter each way per step, against parallel.offload = 'params', which moves the weights per
micro-batch.

The moments are DTensors where the parameter is one (same mesh and placements, host local tensors, as FSDP2's own
CPU offload keeps its shards), so checkpoints store them by global shape and reshard; a checkpoint loads them into
host tensors (`state_like`; moeflow/train/state_dict.py), and a state that arrives on the device anyway (an
expert's, resharded) moves to the host at the next step. The master copies are not state: they equal the (fp32)
weights, and are taken from them at the first step after the optimizer is built or a state is loaded (a new
state dict for the parameter).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

HOST = torch.device("cpu")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _host_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a host tensor shaped as p's shard) as p is: a DTensor over p's mesh where p is one."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride())
    return local


def _pinned(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(like.shape, dtype=torch.float32, device=HOST, pin_memory=torch.cuda.is_available())


class HostOffloadAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (the same arguments, param groups, state names and update) whose state and update are in
    host memory."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        # parameter -> (the state dict its master belongs to, its fp32 shard on the host): a loaded state is a new
        # dict (load_state_dict, moeflow.train.state_dict.apply), after which the master is taken again
        self._masters: dict[torch.Tensor, tuple[dict, torch.Tensor]] = {}
        self._grads: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> the host buffer of its gradient shard

    def state_like(self, p: torch.Tensor) -> torch.Tensor:
        """An uninitialised host tensor shaped as p's moments (what a checkpoint's are loaded into)."""
        return _host_like(p, torch.empty(_local(p).shape, dtype=torch.float32, device=HOST))

    def _state(self, p: torch.Tensor) -> dict:
        """p's state on the host (created zero, or moved there once after a load)."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, device=HOST)
            state["exp_avg"], state["exp_avg_sq"] = (_host_like(p, torch.zeros_like(_local(p), dtype=torch.float32,
                                                                                  device=HOST)) for _ in range(2))
        for key in ("exp_avg", "exp_avg_sq"):
            if _local(state[key]).device != HOST:  # loaded onto the parameter's device (an expert's, resharded)
                host = self.state_like(p)
                _local(host).copy_(_local(state[key]))
                state[key] = host
        state["step"] = state["step"].to(HOST, torch.float32)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copied, work = [], []  # (parameters, (group, its host tensors)) of the step
        for group in self.param_groups:
            tensors = ([], [], [], [], [])  # masters, gradient buffers, exp_avgs, exp_avg_sqs, steps
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state(p)
                if p not in self._masters or self._masters[p][0] is not state:
                    self._masters[p] = (state, _pinned(_local(p)))
                    self._masters[p][1].copy_(_local(p))
                if p not in self._grads:
                    self._grads[p] = _pinned(_local(p))
                self._grads[p].copy_(_local(p.grad), non_blocking=True)
                for out, t in zip(tensors, (self._masters[p][1], self._grads[p], _local(state["exp_avg"]),
                                            _local(state["exp_avg_sq"]), state["step"])):
                    out.append(t)
                copied.append(p)
            if tensors[0]:
                work.append((group, tensors))
        if work and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # every gradient's copy has landed (one wait per step)
        for group, (params, grads, exp_avgs, exp_avg_sqs, steps) in work:
            beta1, beta2 = group["betas"]
            adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=True, amsgrad=group["amsgrad"],
                 beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                 maximize=group["maximize"], decoupled_weight_decay=True)
        for p in copied:
            _local(p).copy_(self._masters[p][1], non_blocking=True)
        return loss
