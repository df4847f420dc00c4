"""The building blocks every DeepSeek generation shares, written on the OpTable: where parameters
are allocated (``Alloc``), linears in bf16 or block FP8, RMSNorm weights, the SwiGLU MLP and the
fused routed experts; ``checkpoint_weights`` names a Linear's weight back as checkpoint keys.

Parameters are allocated with ``torch.empty``: a model is unusable until the loader has filled
every parameter and called its ``post_load``.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer_core.ops import OpTable
from deepinfer_core.ops.linear import MXFP4_GROUP, dequantize_fp8_block

FP8_DTYPE = torch.float8_e4m3fn


def param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def scale_grid(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    return -(-n // block[0]), -(-k // block[1])


class Alloc:
    """Where and in which dtypes a model's parameters are created."""

    def __init__(self, dtype: torch.dtype, device: torch.device, fp8_block: tuple[int, int] | None,
                 expert_slots: tuple[int, ...] | None = None, fp4_experts: bool = False):
        self.dtype = dtype
        self.device = device
        self.fp8_block = fp8_block  # set only when block-FP8 weights are kept quantised
        # Expert parallelism: the logical expert of each routed-expert slot this process holds
        # (the same in every MoE layer at load); None: every expert, slot e = expert e.
        self.expert_slots = expert_slots
        self.fp4_experts = fp4_experts  # routed experts kept packed MXFP4 (uint8), as V4 checkpoints store them

    def every_expert(self) -> Alloc:
        """The same allocation with every routed expert (no expert-parallel slots)."""
        return Alloc(self.dtype, self.device, self.fp8_block, fp4_experts=self.fp4_experts)


class Linear(nn.Module):
    """y = x W^T (+ b) through ops.linear, or ops.fp8_block_linear when W is block-FP8."""

    def __init__(self, in_features: int, out_features: int, ops: OpTable, alloc: Alloc, *, bias: bool = False, fp8: bool = True):
        super().__init__()
        self.ops = ops
        self.block = alloc.fp8_block if fp8 else None
        if self.block is None:
            self.weight = param((out_features, in_features), alloc.dtype, alloc.device)
            self.weight_scale_inv = None
        else:
            self.weight = param((out_features, in_features), FP8_DTYPE, alloc.device)
            self.weight_scale_inv = param(scale_grid(out_features, in_features, self.block), torch.float32, alloc.device)
        self.bias = param((out_features,), alloc.dtype, alloc.device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is None:
            return self.ops.linear(x, self.weight, self.bias)
        return self.ops.fp8_block_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    @classmethod
    def stacked(cls, first: Linear, second: Linear) -> Linear:
        """One Linear computing [first(x) | second(x)] (same input; no bias, same block layout)."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.ops, fused.block, fused.bias = first.ops, first.block, None
        fused.weight = nn.Parameter(torch.cat([first.weight, second.weight]), requires_grad=False)
        scales = first.weight_scale_inv
        fused.weight_scale_inv = None if scales is None else nn.Parameter(torch.cat([scales, second.weight_scale_inv]), requires_grad=False)
        return fused

    def release(self) -> None:
        """Free the weights (after they were copied into a fused layer)."""
        for name in ("weight", "weight_scale_inv"):
            if getattr(self, name) is not None:
                getattr(self, name).data = torch.empty(0, dtype=getattr(self, name).dtype, device=getattr(self, name).device)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.weight_scale_inv is None:
            return self.weight.detach().to(dtype)
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, alloc: Alloc):
        super().__init__()
        self.weight = param((dim,), alloc.dtype, alloc.device)
        self.eps = eps


class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x). Dense layers and the MoE shared experts."""

    stacked_name = "gate_up_proj"  # the Linear that stacks two of the checkpoint's (see unstacked)

    def __init__(self, hidden: int, intermediate: int, ops: OpTable, alloc: Alloc):
        super().__init__()
        self.ops = ops
        self.gate_proj = Linear(hidden, intermediate, ops, alloc)
        self.up_proj = Linear(hidden, intermediate, ops, alloc)
        self.down_proj = Linear(intermediate, hidden, ops, alloc)
        self.gate_up_proj: Linear | None = None  # set by fuse(): one GEMM instead of two

    def fuse(self) -> None:
        """After loading: stack gate and up into one weight (unless FP8 blocks would straddle them)."""
        g, u = self.gate_proj, self.up_proj
        if self.gate_up_proj is not None or g.bias is not None or (g.block is not None and g.weight.shape[0] % g.block[0]):
            return
        self.gate_up_proj = Linear.stacked(g, u)
        g.release()
        u.release()

    def unstacked(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """``gate_up_proj``'s weight (or a tensor of its rows) split back into gate_proj and up_proj."""
        gate, up = weight.chunk(2)
        return {"gate_proj": gate, "up_proj": up}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
        else:
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        return self.down_proj(self.activation(gate_up))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2I] = [gate | up] -> [..., I]: SwiGLU."""
        return self.ops.silu_and_mul(gate_up)


class Experts(nn.Module):
    """Routed experts, fused: gate_up_proj [E, 2I, D] (gate rows, then up rows), down_proj [E, D, I];
    under expert parallelism E is the number of this process's slots (``alloc.expert_slots``).
    With ``alloc.fp4_experts`` they stay packed MXFP4 as the checkpoint holds them (``fp4``; the
    convention of ops.moe.moe_experts): gate_up_proj uint8 [E, 2I, D/2], down_proj uint8
    [E, D, I/2], and their UE8M0 scale bytes in ``*_scale_inv`` (uint8 [E, 2I, ceil(D/32)],
    [E, D, ceil(I/32)]: the name the checkpoint formats map scales to; they multiply).
    ``room``: rows for that many more experts are allocated past the E (each parameter is a view of
    the first E rows of its ``whole`` tensor), where ``MoE.fuse_shared`` appends the shared experts
    without copying the routed ones."""

    def __init__(self, config, alloc: Alloc, room: int = 0):
        super().__init__()
        e = config.n_routed_experts if alloc.expert_slots is None else len(alloc.expert_slots)
        if alloc.expert_slots is not None and not all(0 <= x < config.n_routed_experts for x in alloc.expert_slots):
            raise ValueError(f"expert_slots {alloc.expert_slots} name experts outside 0..{config.n_routed_experts - 1}")
        d, i = config.hidden_size, config.moe_intermediate_size
        self.block = alloc.fp8_block
        self.fp4 = alloc.fp4_experts
        self.slots = alloc.expert_slots  # None: every routed expert, slot e = expert e
        self.num_experts = config.n_routed_experts  # the model's logical experts (this process may hold fewer)
        self.whole: dict[str, torch.Tensor] = {}  # name -> [E + room, ...] (only with room)

        def slot_param(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
            whole = torch.empty((shape[0] + room, *shape[1:]), dtype=dtype, device=alloc.device)
            if room:
                self.whole[name] = whole
            return nn.Parameter(whole[: shape[0]], requires_grad=False)

        if self.fp4:
            if d % 2 or i % 2 or self.block is not None:
                raise ValueError(f"packed MXFP4 experts need even hidden ({d}) and intermediate ({i}) sizes and no FP8 block")
            self.gate_up_proj = slot_param("gate_up_proj", (e, 2 * i, d // 2), torch.uint8)
            self.down_proj = slot_param("down_proj", (e, d, i // 2), torch.uint8)
            self.gate_up_proj_scale_inv = slot_param("gate_up_proj_scale_inv", (e, 2 * i, -(-d // MXFP4_GROUP)), torch.uint8)
            self.down_proj_scale_inv = slot_param("down_proj_scale_inv", (e, d, -(-i // MXFP4_GROUP)), torch.uint8)
        elif self.block is None:
            self.gate_up_proj = slot_param("gate_up_proj", (e, 2 * i, d), alloc.dtype)
            self.down_proj = slot_param("down_proj", (e, d, i), alloc.dtype)
            self.gate_up_proj_scale_inv = self.down_proj_scale_inv = None
        else:
            if i % self.block[0]:
                raise ValueError(
                    f"moe_intermediate_size={i} is not a multiple of the FP8 block {self.block[0]}: the fused "
                    "gate/up scales cannot be kept; load with FP8 weights dequantised instead"
                )
            self.gate_up_proj = slot_param("gate_up_proj", (e, 2 * i, d), FP8_DTYPE)
            self.down_proj = slot_param("down_proj", (e, d, i), FP8_DTYPE)
            self.gate_up_proj_scale_inv = slot_param("gate_up_proj_scale_inv", (e, *scale_grid(2 * i, d, self.block)), torch.float32)
            self.down_proj_scale_inv = slot_param("down_proj_scale_inv", (e, *scale_grid(d, i, self.block)), torch.float32)


def checkpoint_weights(model: nn.Module, module_name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The weight of the model's Linear ``module_name`` (or a tensor of its rows, e.g. dequantised)
    under the checkpoint's keys: a stacked one (``MLP.gate_up_proj``, ``Attention.qkv_a_proj``) split
    back by its parent's ``unstacked``, any other as ``<module_name>.weight``."""
    parent_name, _, leaf = module_name.rpartition(".")
    parent = model.get_submodule(parent_name)
    if leaf == getattr(parent, "stacked_name", None):
        return {f"{parent_name}.{proj}.weight": part for proj, part in parent.unstacked(weight).items()}
    return {f"{module_name}.weight": weight}
