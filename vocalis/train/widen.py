"""A wider HiFT vocoder that starts where a narrower one stopped (function-preserving widening).

Every hidden channel of the generator's main path (conv_pre -> ups -> resblocks -> conv_post, and the source
branch's `source_downs` / `source_resblocks` that add into it) is copied `factor` times. A layer producing hidden
channels repeats its output rows (and bias, and Snake's alpha); a layer reading them gives each copy a random share
of the original input weight, the shares of one weight summing to 1. Given the copied input, every output equals
the narrow one's, so the wide vocoder starts at the narrow one's quality; the shares differ between the copies, so
their gradients differ and the copies grow apart in training. The F0 predictor and NSF source keep their sizes.

Weight-normed convolutions are widened on their effective weight `g * v / ||v||` and written back with
`v = w, g = ||w||`, which is the same weight.
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from vocalis.config import HiFTConfig

_G, _V = "parametrizations.weight.original0", "parametrizations.weight.original1"
# modules whose weights read (in) / write (out) main-path hidden channels
_READS = re.compile(r"^(ups\.\d+|resblocks\.\d+\.convs[12]\.\d+|source_resblocks\.\d+\.convs[12]\.\d+|conv_post)$")
_WRITES = re.compile(r"^(conv_pre|ups\.\d+|resblocks\.\d+\.convs[12]\.\d+|source_resblocks\.\d+\.convs[12]\.\d+"
                     r"|source_downs\.\d+)$")
_ALPHA = re.compile(r"^(source_)?resblocks\.\d+\.activations[12]\.\d+\.alpha$")


def _norm_except(w: torch.Tensor, dim: int) -> torch.Tensor:
    """||w|| over every dim but `dim`, kept for broadcasting (torch's weight_norm)."""
    dims = [d for d in range(w.dim()) if d != dim]
    return w.norm(dim=dims, keepdim=True)


def _split(w: torch.Tensor, dim: int, factor: int, generator: torch.Generator) -> torch.Tensor:
    """Input dim `dim` of size C -> C * factor: copy k of input i gets share r_k of w (shares sum to 1 per weight)."""
    shape = list(w.shape)
    shape.insert(dim, factor)  # (..., factor, C, ...) before the reshape
    share = 1.0 + 0.4 * (torch.rand(shape, generator=generator, dtype=torch.float64) - 0.5)  # around 1, +-20 %
    share = share / share.sum(dim=dim, keepdim=True)
    out = (w.double().unsqueeze(dim) * share).to(w.dtype)
    return out.flatten(dim, dim + 1)


def _repeat(w: torch.Tensor, dim: int, factor: int) -> torch.Tensor:
    """Output dim `dim` of size C -> C * factor, copies of the whole block (channel c -> c, c + C, ...)."""
    reps = [1] * w.dim()
    reps[dim] = factor
    return w.repeat(*reps)


def widen_hift(state: dict[str, torch.Tensor], config: HiFTConfig, channels: int,
               seed: int = 0) -> tuple[dict[str, torch.Tensor], HiFTConfig]:
    """HiFT weights at `config.base_channels` -> weights at `channels` (a whole multiple) computing the same audio
    for the same source. -> (state dict, the wider config)."""
    if channels % config.base_channels or channels < config.base_channels:
        raise ValueError(f"HiFT can widen to a multiple of {config.base_channels} channels, not {channels}")
    factor = channels // config.base_channels
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    modules = sorted({k.rsplit(".", 1)[0] if not k.endswith((_G, _V)) else k[: -len(_G) - 1] for k in state})
    for name in modules:
        reads = bool(_READS.match(name))
        writes = bool(_WRITES.match(name) or _ALPHA.match(f"{name}.alpha"))
        if not (reads or writes):
            out.update({k: state[k].float() for k in state if k.startswith(name + ".")
                        and (k.count(".") == name.count(".") + 1 or k.startswith(f"{name}.parametrizations."))})
            continue
        transposed = name.startswith("ups.")  # ConvTranspose1d weight: (in, out, k); Conv1d: (out, in, k)
        in_dim, out_dim = (0, 1) if transposed else (1, 0)
        if f"{name}.{_V}" in state:
            # torch's weight_norm keeps g over dim 0 for both conv kinds
            v, gain = state[f"{name}.{_V}"].float(), state[f"{name}.{_G}"].float()
            w = gain * v / _norm_except(v, 0)
            if reads and writes:  # each output copy takes its own shares of the input weight
                w = torch.cat([_split(w, in_dim, factor, g) for _ in range(factor)], dim=out_dim)
            elif reads:
                w = _split(w, in_dim, factor, g)
            elif writes:
                w = _repeat(w, out_dim, factor)
            out[f"{name}.{_V}"] = w
            out[f"{name}.{_G}"] = _norm_except(w, 0)
            if f"{name}.bias" in state:
                b = state[f"{name}.bias"].float()
                out[f"{name}.bias"] = _repeat(b, 0, factor) if writes else b
            continue
        if reads:  # every module reading hidden channels is weight-normed in HiFT
            raise ValueError(f"HiFT widening: {name} reads hidden channels without weight norm")
        for key in (k for k in state if k.startswith(name + ".") and k.count(".") == name.count(".") + 1):
            out[key] = _repeat(state[key].float(), 0, factor)  # source_downs' weight and bias, Snake's alpha
    missing = set(state) - set(out)
    if missing:
        raise ValueError(f"HiFT widening left out {sorted(missing)[:4]}")
    return out, replace(config, base_channels=channels)

