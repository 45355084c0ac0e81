"""Tensor-parallel styles beyond torch's (torch.distributed.tensor.parallel): how a module runs on the tp ranks
where column / row sharding and SequenceParallel do not say it, each a ParallelStyle a plan names
(moeflow.parallel.tensor, where the layout they serve is drawn).

    ReplicatedModule, WholeEmbedding, WholeMixer   the whole module on every tp rank, on the gathered sequence
    LocalTokens, PerTokenPart                      the module on this rank's sequence slice only
    HeadShardedNorm, WidthShardedNorm              query/key norms over each head, or over all heads
    PartialGradColwise, LocalInput                 latent attention's per-head and shared projections
    HeadShardedParameters, ReplicatedParameters    a module's own parameters by head, or replicated
    Styles                                         several styles on one module
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle


def _on_input(style: ParallelStyle, module: nn.Module, args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    """(args, kwargs) with `fn` applied to the module's input: the first positional argument, or `hidden_states=`."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    raise ValueError(f"{type(style).__name__}: {type(module).__name__} got no positional input nor hidden_states=")


def _on_output(output, fn):
    """`output` with `fn` applied to it, or to its first element where it is a tuple."""
    return (fn(output[0]), *output[1:]) if isinstance(output, tuple) else fn(output)


class ReplicatedModule(ParallelStyle):
    """Run the whole module on every tp rank, on the all-gathered sequence, with its own plain parameters.

    Input (the first positional argument, or `hidden_states=`): a sequence-sharded DTensor (or this rank's
    plain slice of one), all-gathered and handed over as a plain tensor. Output (or the first element of a
    tuple output): the plain result, taken as Replicate and cut to this rank's sequence slice, which needs no
    communication (its backward all-gathers the gradient). Every tp rank computes the same thing, so the
    module's parameter gradients agree across tp ranks without any reduction. Linear modules inside are
    covered by this entry: apply_tensor_parallel does not ask for a plan for them.
    """

    def __init__(self, *, sequence_dim: int = 1):
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        sequence_sharded = [Shard(self.sequence_dim)]

        def gather(x):
            if not isinstance(x, torch.Tensor):
                return x
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, sequence_sharded, run_check=False)
            return x.redistribute(placements=[Replicate()]).to_local()

        def scatter(y):
            return DTensor.from_local(y, device_mesh, [Replicate()], run_check=False).redistribute(
                placements=sequence_sharded)

        def gather_input(mod, args, kwargs):
            return _on_input(self, mod, args, kwargs, gather)

        def scatter_output(mod, args, kwargs, output):
            return _on_output(output, scatter)

        module.register_forward_pre_hook(gather_input, with_kwargs=True)
        module.register_forward_hook(scatter_output, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"ReplicatedModule(sequence_dim={self.sequence_dim})"


class WholeEmbedding(ReplicatedModule):
    """An embedding that holds more than its table (a norm applied to each looked-up row: Inkling's), which a
    vocab-sharded lookup cannot feed (its output would be partial rows, normed before they are summed): the whole
    table on every tp rank, the token ids as they come (every tp rank has them all), the output cut to this rank's
    sequence slice (its backward all-gathers the gradient, so every rank's table gradient is the same)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def scatter_output(mod, args, output):
            return DTensor.from_local(output, device_mesh, [Replicate()], run_check=False).redistribute(
                placements=[Shard(self.sequence_dim)])

        module.register_forward_hook(scatter_output)
        return module

    def __repr__(self) -> str:
        return "WholeEmbedding()"


class WholeMixer(ReplicatedModule):
    """ReplicatedModule for a layer's token mixer that the built-in plan cannot shard (a linear attention, a Mamba
    mixer, an attention with a sparse-attention indexer): the layer's FFN and the other layers' attention stay
    tensor-parallel; this mixer's parameters are replicated over tp, their gradients averaged over the tp ranks
    after backward (moeflow.parallel.grads: the same on every rank, but for a GPU kernel's summation order)."""

    def __repr__(self) -> str:
        return "WholeMixer()"


class LocalTokens(ParallelStyle):
    """Run the module on this tp rank's sequence slice only: the sequence-sharded DTensor input becomes its local
    [.., S/tp, ..] tensor and the plain output becomes this rank's slice of a sequence-sharded DTensor. No
    communication: the MoE layer's tokens enter as the sequence-parallel shard (Megatron's "MoE parallel folding"),
    and expert parallelism over the tp ranks (moeflow.parallel.expert) moves them to their experts. The module's
    replicated parameters (router, shared experts) then get only this rank's tokens' gradient: parallelize
    sums the router's over the tp ranks after backward (moeflow.parallel.grads) and shards the shared experts
    with FSDP over the dp x cp x tp ranks, whose reduce-scatter sums theirs (moeflow.parallel.fsdp)."""

    def __init__(self, *, sequence_dim: int = 1):
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        sequence_sharded = [Shard(self.sequence_dim)]

        def local(x):
            return x.to_local() if isinstance(x, DTensor) else x

        def to_dtensor(y):
            return DTensor.from_local(y, device_mesh, sequence_sharded, run_check=False)

        def local_input(mod, args, kwargs):
            if kwargs.get("input_ids") is not None:  # an MoE routed by the token ids (DeepSeek-V4's hash routing)
                x = args[0] if args else kwargs.get("hidden_states")
                kwargs = {**kwargs, "input_ids": local_ids(mod, kwargs["input_ids"], x)}
            return _on_input(self, mod, args, kwargs, local)

        def local_ids(mod, ids, x):
            # the whole sequence's [B, S] ids, cut as Shard(dim) cuts the hidden states (torch.chunk's sizes; the
            # sequence divides by tp)
            dim = self.sequence_dim
            if not isinstance(x, DTensor) or ids.ndim <= dim or ids.shape[dim] != x.shape[dim]:
                raise ValueError(f"tensor parallelism: {type(mod).__name__} takes input_ids "
                                 f"{tuple(ids.shape)} that are not the whole sequence of its sequence-sharded "
                                 f"hidden states; use ep and data parallelism instead")
            return ids.chunk(device_mesh.size(), dim=dim)[device_mesh.get_local_rank()]

        def sharded_output(mod, args, kwargs, output):
            return _on_output(output, to_dtensor)

        module.register_forward_pre_hook(local_input, with_kwargs=True)
        module.register_forward_hook(sharded_output, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"LocalTokens(sequence_dim={self.sequence_dim})"


class PerTokenPart(LocalTokens):
    """LocalTokens for a part of a layer that works token by token beside its token mixer (a hyper-connection, a
    gated or scaled residual): every sequence-sharded input (it may take the residual and the mixer's output)
    becomes its local tensor, every output of this rank's sequence length a sequence-sharded DTensor. Its
    replicated parameters get this rank's tokens' gradient only: summed over tp after backward
    (moeflow.parallel.grads)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        dim = self.sequence_dim
        lengths: list[int] = []

        def local_inputs(mod, args, kwargs):
            lengths.clear()  # this call's, set by its sequence-sharded inputs
            return local(args), {k: local(v) for k, v in kwargs.items()}

        def local(x):
            if isinstance(x, DTensor):
                x = x.to_local()
                lengths[:] = [x.shape[dim]]
            return tuple(local(v) for v in x) if isinstance(x, tuple) else x

        def sharded(y):
            if isinstance(y, tuple):
                return tuple(sharded(v) for v in y)
            if isinstance(y, torch.Tensor) and y.ndim > dim and lengths and y.shape[dim] == lengths[0]:
                return DTensor.from_local(y, device_mesh, [Shard(dim)], run_check=False)
            return y

        module.register_forward_pre_hook(local_inputs, with_kwargs=True)
        module.register_forward_hook(lambda mod, args, kwargs, output: sharded(output), with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return "PerTokenPart()"


class HeadShardedNorm(SequenceParallel):
    """A norm over each head's width (Qwen3's q_norm / k_norm) applied to the local heads of a tp rank.

    The weight [Dh] is shared by all heads, so each rank's heads contribute part of its gradient. Wrapping the
    local [.., H/tp, ..] input as a DTensor sharded on the head dim and the weight as a Replicate DTensor makes
    autograd sum those parts over the tp ranks (HF calls this 'replicated_with_grad_allreduce'). The output is
    the plain local tensor again.
    """

    def __init__(self, *, head_dim_index: int):
        super().__init__(sequence_dim=head_dim_index, use_local_output=True)


class _ReplicatedWithPartialGrad(torch.autograd.Function):
    """A plain tensor, identical on every tp rank, as a Replicate DTensor whose gradient goes back as this rank's
    partial sum (no all-reduce): summed once, further back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mesh) -> DTensor:
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor):
        return grad.redistribute(placements=[Partial()]).to_local(), None


class PartialGradColwise(ColwiseParallel):
    """ColwiseParallel for a linear whose input is plain and replicated inside a tensor-parallel module (latent
    attention's up-projections): the input gradient it hands back stays this rank's partial sum (ColwiseParallel
    would all-reduce it), like every other gradient inside the module."""

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        x = inputs[0]
        return x if isinstance(x, DTensor) else _ReplicatedWithPartialGrad.apply(x, device_mesh)


class LocalInput(ParallelStyle):
    """A module kept whole on every tp rank inside a tensor-parallel one (latent attention's down-projections):
    its Replicate DTensor input becomes the plain local tensor, whose gradient goes back as this rank's partial
    sum (the module's input gather sums those over tp), and its parameters stay plain: their gradients, partial
    too, are summed over tp after backward (ParallelState.tp_partial)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def local(mod, args):
            x = args[0]
            if isinstance(x, DTensor):
                x = x.to_local(grad_placements=[Partial()])
            return (x, *args[1:])

        module.register_forward_pre_hook(local)
        return module

    def __repr__(self) -> str:
        return "LocalInput()"


class WidthShardedNorm(ParallelStyle):
    """RMSNorm over the full width of a column-sharded activation (OLMoE's qk_norm 'full', over all heads).

    The input is this rank's columns [..., W/tp] (a ColwiseParallel output); the weight [W] is sharded the same
    way. As DTensors, the mean of squares over the sharded last dim becomes a partial sum that DTensor
    all-reduces ([..., 1] numbers), and the weight's gradient stays on its shard.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def shard_weight(name, mod, mesh):
            for p_name, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(p_name, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        def to_dtensor(mod, inputs, mesh):
            return DTensor.from_local(inputs[0], mesh, [Shard(-1)], run_check=False)

        def to_local(mod, outputs, mesh):
            return outputs.to_local()

        return distribute_module(module, device_mesh, shard_weight, to_dtensor, to_local)

    def __repr__(self) -> str:
        return "WidthShardedNorm()"


class HeadShardedParameters(ParallelStyle):
    """Parameters with one row per query head (gpt-oss's attention sinks [H]) sharded over tp as the heads are:
    tp rank r holds the rows of its heads [r H/tp, (r+1) H/tp). The module's own forward reads the attribute as a
    plain tensor, so during its forward the attribute is this rank's local rows (a view whose gradient flows back
    to the DTensor parameter)."""

    def __init__(self, names: tuple[str, ...]):
        super().__init__()
        self.names = tuple(names)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        names = [name for name in self.names if module._parameters.get(name) is not None]  # not every layer's
        for name in names:
            param = module._parameters[name]
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), device_mesh, [Shard(0)]),
                                                         requires_grad=param.requires_grad))

        def local_rows(mod, args, kwargs):
            for name in names:  # an instance attribute is found before nn.Module's parameter lookup
                object.__setattr__(mod, name, mod._parameters[name].to_local())

        def parameters_again(mod, args, kwargs, output):
            for name in names:
                mod.__dict__.pop(name, None)

        module.register_forward_pre_hook(local_rows, with_kwargs=True)
        module.register_forward_hook(parameters_again, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"HeadShardedParameters({self.names})"


class ReplicatedParameters(ParallelStyle):
    """A module's own parameters (not its children's) as Replicate DTensors: the base model's input scale and bias
    (Zaya's), which it applies to the sequence-sharded embedding output itself, outside any module. DTensor's
    arithmetic then keeps the activation sharded and sums the parameters' gradients over tp. (A model that applied
    such a parameter to a plain tensor instead would stop at its first forward, mixing a tensor and a DTensor.)"""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), device_mesh, [Replicate()]),
                                                         requires_grad=param.requires_grad))
        return module

    def __repr__(self) -> str:
        return "ReplicatedParameters()"


class Styles(ParallelStyle):
    """Several styles on one module, applied in order (a plan holds one style per module pattern)."""

    def __init__(self, *styles: ParallelStyle):
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        return f"Styles{self.styles}"
