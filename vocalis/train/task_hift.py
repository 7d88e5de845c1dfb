"""HiFT task: GAN training of the vocoder against multi-period + multi-resolution discriminators
(`hift_gan.py`), with mel L1, feature matching, TPR and F0 losses.

Per micro-batch, one generator forward, then (as the official recipe) the discriminator turn and its update,
then the generator turn and its update, each with its own optimizer, scheduler and grad scaler. During the
generator turn the discriminator is frozen (requires_grad off, called outside DDP), so its gradients come only
from its own turn and are never synchronised twice.

With `hift.adversarial=none` (the critic-free warm-up) there is no discriminator at all: no module, optimizer group
or checkpoint entry. A GAN run resumed from such a checkpoint starts its critic fresh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from vocalis.models.hift.generator import HiFTGenerator
from vocalis.train.config import TrainConfig
from vocalis.train.data import Batch
from vocalis.train.discriminators import DiscriminatorConfig, HiFTDiscriminator
from vocalis.train.hift_gan import (
    HiFTLossConfig,
    discriminator_loss,
    generator_forward,
    generator_losses,
    reconstruction_losses,
)
from vocalis.train.task import StepContext, Task, Wrap, build_part


@contextlib.contextmanager
def frozen(module: nn.Module) -> Iterator[nn.Module]:
    """`module` with every parameter's requires_grad off for the duration (inputs still get gradients)."""
    flags = [p.requires_grad for p in module.parameters()]
    module.requires_grad_(False)
    try:
        yield module
    finally:
        for p, flag in zip(module.parameters(), flags):
            p.requires_grad_(flag)


class HiFTTask(Task):
    name = "hift"

    def __init__(self, config: TrainConfig) -> None:
        hift, self.model_config = build_part(config, "hift")
        assert isinstance(hift, HiFTGenerator)
        c = config.hift
        self.losses = HiFTLossConfig(mel_weight=c.mel_weight, feature_weight=c.feature_weight,
                                     tpr_weight=c.tpr_weight, f0_weight=c.f0_weight,
                                     adversarial=c.adversarial,  # type: ignore[arg-type]
                                     extra_mel_ffts=tuple(c.extra_mel_ffts), stft_weight=c.stft_weight,
                                     stft_resolutions=tuple(tuple(r) for r in c.stft_resolutions))
        self.discriminator_lr = c.discriminator_lr
        self.modules: dict[str, nn.Module] = {"hift": hift}
        self.generator: nn.Module = hift  # DDP-wrapped when distributed
        self.critic: nn.Module | None = None  # DDP-wrapped when distributed
        if self.losses.adversarial != "none":
            # Critic-free runs build none: it would only add ~40 M idle parameters to memory and every checkpoint.
            disc = HiFTDiscriminator(DiscriminatorConfig(periods=c.periods, period_channels=c.period_channels,
                                                         spec_channels=c.spec_channels,
                                                         resolutions=tuple(tuple(r) for r in c.spec_resolutions)))
            self.modules["discriminator"] = self.critic = disc

    def groups(self) -> dict[str, list[nn.Parameter]]:
        out = {"generator": list(self.modules["hift"].parameters())}
        if "discriminator" in self.modules:
            out = {"discriminator": list(self.modules["discriminator"].parameters()), **out}
        return out

    def optional_parts(self) -> frozenset[str]:
        # A GAN run may resume from its critic-free warm-up: the critic then starts fresh.
        return frozenset({"discriminator"})

    def group_lr(self, group: str, config: TrainConfig) -> float:
        if group == "discriminator" and self.discriminator_lr is not None:
            return self.discriminator_lr
        return config.optim.lr

    def wrap(self, wrap: Wrap) -> None:
        self.generator = wrap(self.generator)
        if self.critic is not None:
            self.critic = wrap(self.critic)

    def checkpointed_layers(self):
        hift = self.modules["hift"]
        yield from hift.resblocks
        yield from hift.source_resblocks

    def micro_step(self, batch: Batch, ctx: StepContext) -> dict[str, float]:
        mel = batch.mel.transpose(1, 2)  # (B, 80, T)
        with ctx.autocast():
            fake = generator_forward(self.generator, mel, ctx.generator)  # wav (B, 480 T), f0 (B, T)
        if self.losses.adversarial == "none":  # warm-up: no critic at all
            d_logs: dict[str, float] = {}
            with ctx.autocast():
                g_loss, g_logs = reconstruction_losses(fake, batch.audio, batch.f0, self.losses)
        else:
            assert self.critic is not None
            with ctx.autocast():
                d_loss, d_logs = discriminator_loss(self.critic, batch.audio, fake.wav, self.losses)
            ctx.backward(d_loss, "discriminator")
            ctx.update("discriminator")
            with frozen(self.modules["discriminator"]) as critic, ctx.autocast():
                g_loss, g_logs = generator_losses(critic, fake, batch.audio, batch.f0, self.losses)
        ctx.backward(g_loss, "generator")
        ctx.update("generator")
        return {"loss": g_logs["loss_mel"], **{f"g_{k[5:]}": v for k, v in g_logs.items()},
                **{f"d_{k.removeprefix('loss_')}": v for k, v in d_logs.items()}}
