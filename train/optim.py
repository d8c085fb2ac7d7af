"""The optimizer of a run (`optim.name`): AdamW, or Muon on the hidden matrices with AdamW on the rest.

Muon orthogonalises a whole matrix's update, so it applies only to the transformer's hidden
matrices: the attention projections (qkv / q, k, v, proj) and the MLP's. Everything else (the
embedding, the output head, norms, biases, and every design's own parameters: a `ScoreBias`, a
q/k transform, stick-breaking's `attend`, FoX Pro's parts, sinks, SSMax) stays on AdamW. The rule
is structural, not a list of names: Muon takes the `nn.Linear` children of each block's attention
and MLP modules; a design's parameters live in modules of its own type (`Design.bias`, `transform`,
`attend`, `pro`) or in vectors, never in those children.

Under ZeRO 0 the optimizer is `MuonAdamW`: torch's `Muon` and `AdamW` over one set of param groups
and one state, so DeepSpeed checkpoints it as one optimizer. ZeRO 1 and 2 flatten parameters into
partitions, where torch's Muon (whole 2-D matrices only) cannot run: there DeepSpeed's own
`MuonWithAuxAdam` serves, whose ZeRO optimizer orthogonalises each full gradient before it is
partitioned (`stage_1_and_2.get_flat_partition`); it runs Nesterov with 5 Newton-Schulz steps and
the `original` lr adjustment only, so other settings are refused there (`train.config.muon_refusal`).

Every group carries `lr_scale`, its peak learning rate relative to `optim.lr`: the one schedule
(`train.schedule`) sets each group to lr_at(step) x lr_scale, so Muon's group follows the same
warm-up and decay at its own peak (`optim.muon_lr`), and muP's per-layer scaling is a factor in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from train.config import TrainConfig

Multipliers = Callable[[nn.Parameter, bool], float]


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The Muon parameters: the weights of the `nn.Linear` children of every block's `attn` and `mlp`."""
    found: list[nn.Parameter] = []
    for block in model.h:
        for part in (block.attn, block.mlp):
            found += [child.weight for child in part.children() if isinstance(child, nn.Linear)]
    return found


def param_groups(model: nn.Module, cfg: TrainConfig, multiplier: Multipliers | None = None) -> list[dict[str, Any]]:
    """The run's param groups: for AdamW, matrices decayed and vectors not; for Muon, the hidden
    matrices as Muon groups (`use_muon`) and the rest as AdamW groups. `multiplier(p, muon)` is a
    parameter's lr factor (muP's per-layer scaling, `model.mup`); parameters of one factor share a group."""
    o = cfg.optim
    muon = {id(p) for p in hidden_matrices(model)} if o.name == "muon" else set()
    keyed: dict[tuple[bool, bool, float], list[nn.Parameter]] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        use_muon = id(p) in muon
        scale = 1.0 if multiplier is None else multiplier(p, use_muon)
        keyed.setdefault((use_muon, p.dim() >= 2, scale), []).append(p)
    groups = []
    for (use_muon, decay, scale), params in keyed.items():
        if use_muon:
            groups.append({"params": params, "use_muon": True, "weight_decay": o.muon_weight_decay,
                           "lr_scale": o.muon_lr / o.lr * scale})
        else:
            groups.append({"params": params, "use_muon": False, "weight_decay": o.weight_decay if decay else 0.0,
                           "betas": (o.beta1, o.beta2), "eps": o.eps, "lr_scale": scale})
    return groups


class MuonAdamW(torch.optim.Optimizer):
    """torch's `Muon` on the `use_muon` groups and `AdamW` on the others, as one optimizer: the groups
    and the state are this optimizer's, so its `state_dict` holds both halves (momentum buffers,
    Adam moments and steps) and a checkpoint restores them."""

    def __init__(self, groups: list[dict[str, Any]], cfg: TrainConfig):
        super().__init__(groups, {})
        o = cfg.optim
        self.muon = torch.optim.Muon(self._half(True), lr=o.muon_lr, weight_decay=o.muon_weight_decay,
                                     momentum=o.muon_momentum, nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps,
                                     adjust_lr_fn=o.muon_adjust_lr)
        self.adamw = torch.optim.AdamW(self._half(False), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
        self._link()

    def _half(self, use_muon: bool) -> list[dict[str, Any]]:
        return [group for group in self.param_groups if group["use_muon"] is use_muon]

    def _link(self) -> None:
        """Point both halves at this optimizer's groups and state (again after a load replaced them)."""
        for half, use_muon in ((self.muon, True), (self.adamw, False)):
            defaults = half.defaults
            half.param_groups = self._half(use_muon)
            for group in half.param_groups:
                for key, value in defaults.items():
                    group.setdefault(key, value)
            half.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.muon.param_groups:
            self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()


def build_muon(model: nn.Module, cfg: TrainConfig, multiplier: Multipliers | None = None) -> torch.optim.Optimizer:
    """`MuonAdamW` under ZeRO 0; DeepSpeed's `MuonWithAuxAdam` (its ZeRO optimizer orthogonalises the
    full gradients, each parameter tagged `use_muon` as DeepSpeed reads it) under ZeRO 1 and 2."""
    groups = param_groups(model, cfg, multiplier)
    if cfg.deepspeed.zero_stage == 0:
        return MuonAdamW(groups, cfg)
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    for group in groups:
        for p in group["params"]:
            p.use_muon = group["use_muon"]
        if group["use_muon"]:
            group.update(lr=cfg.optim.muon_lr, momentum=cfg.optim.muon_momentum, ns_method="standard")
        else:
            group["lr"] = cfg.optim.lr
    return MuonWithAuxAdam(groups)
