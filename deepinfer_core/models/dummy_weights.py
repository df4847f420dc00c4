"""Random weights for a built model (``load_format="dummy"``, benchmarks and tests)."""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from deepinfer_core.models.layers import Experts


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0, progress: bool = True) -> None:
    """Random weights of the right shapes and dtypes, for benchmarks (``load_format="dummy"``).

    Matrices ~ N(0, 1/fan_in) so activations stay O(1) through the layers; norm weights ~ 1;
    router biases ~ 0.01 N(0, 1); hash-routing tables (``tid2eid``) uniform expert ids; block-FP8
    weights are N(0, 1) values in float8_e4m3fn with every block scale 1/sqrt(fan_in); packed MXFP4
    experts (uint8) are uniform random codes with the UE8M0 scale that gives them a root mean
    square near 1/sqrt(fan_in) (uniform E2M1 codes have an rms of 2.93). Generated
    on the model's device (no host copy). The outputs are noise; routing is close to uniform over
    the experts.

    A rank of an expert-parallel group, whose model holds only some expert slots
    (``expert_slots``), draws every routed expert in turn as the single-process model does and
    keeps those of its slots: it gets exactly that model's weights, so random-weight runs at any
    EP size compute the same model.
    """
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    params = dict(model.named_parameters())
    shards = {f"{prefix}.{name}": m for prefix, m in model.named_modules() if isinstance(m, Experts) and m.slots is not None
              for name in ("gate_up_proj", "down_proj")}
    with tqdm(total=len(params), desc="Random weights", unit="tensor", disable=not progress) as bar:
        for name, p in params.items():
            if name.endswith("_scale_inv") and p.dtype == torch.uint8:  # UE8M0 bytes of packed MXFP4 experts
                fan_in = 2 * params[name[: -len("_scale_inv")]].shape[-1]
                p.fill_(127 + round(math.log2(fan_in**-0.5 / 2.93)))
            elif name.endswith("_scale_inv"):
                p.fill_(params[name[: -len("_scale_inv")]].shape[-1] ** -0.5)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * 0.01)
            elif name.endswith("tid2eid"):  # V4 hash routing table: expert ids of the router
                p.copy_(torch.randint(0, params[name[: -len("tid2eid")] + "weight"].shape[0], p.shape, generator=gen, device=p.device))
            else:
                std = 1.0 if p.dtype == torch.float8_e4m3fn else p.shape[-1] ** -0.5

                def draw(shape, p=p, std=std):
                    if p.dtype == torch.uint8:  # packed MXFP4 codes
                        return torch.randint(0, 256, shape, generator=gen, device=p.device, dtype=torch.uint8)
                    return torch.randn(shape, generator=gen, device=p.device) * std

                if name in shards:  # this rank's slots: every expert drawn in turn, this rank's kept (a twice-held one twice)
                    slots = shards[name].slots
                    for expert in range(shards[name].num_experts):
                        part = draw(p.shape[1:])
                        for slot in (s for s, e in enumerate(slots) if e == expert):
                            p[slot].copy_(part)
                else:
                    for part in p if p.dim() == 3 else [p]:  # fused experts one at a time (smaller float32 temporaries)
                        part.copy_(draw(part.shape))
            bar.update()
    for name, b in model.named_buffers():  # router tensors a model may hold as buffers (as transformers' V4)
        if name.endswith("tid2eid"):
            b.copy_(torch.randint(0, params[name[: -len("tid2eid")] + "weight"].shape[0], b.shape, generator=gen, device=b.device))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=gen, device=b.device) * 0.01)
    model.post_load()
