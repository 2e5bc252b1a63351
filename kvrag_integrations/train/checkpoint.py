"""Checkpoints without pickle: trainable weights and AdamW state in safetensors.

A checkpoint is a folder ``<out>/checkpoints/step-000050`` holding
``trainable.safetensors`` (every trainable parameter by name),
``optimizer.safetensors`` (AdamW's per-parameter tensors) and ``state.json``
(the step, the optimizer's param groups, the loss history, the config).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

PREFIX = "step-"


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """The trainable parameters by name (detached, contiguous, on CPU)."""
    return {
        name: p.detach().contiguous().cpu()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def save_checkpoint(
    folder: str | Path,
    model: Any,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write a checkpoint for ``state["step"]`` and keep only the newest ``keep``."""
    root = Path(folder)
    target = root / f"{PREFIX}{int(state['step']):06d}"
    tmp = root / f".tmp-{target.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(trainable_state(model), tmp / "trainable.safetensors")
    opt = optimizer.state_dict()
    tensors = {
        f"{index}/{key}": value.detach().contiguous().cpu()
        for index, per_param in opt["state"].items()
        for key, value in per_param.items()
        if isinstance(value, torch.Tensor)
    }
    save_file(tensors, tmp / "optimizer.safetensors")
    payload = dict(state, param_groups=opt["param_groups"])
    (tmp / "state.json").write_text(json.dumps(payload, indent=1, default=str))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    for old in sorted(root.glob(f"{PREFIX}*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The newest complete checkpoint under ``folder``, or None."""
    done = [p for p in sorted(Path(folder).glob(f"{PREFIX}*")) if (p / "state.json").is_file()]
    return done[-1] if done else None


def load_checkpoint(
    path: str | Path, model: Any, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore weights and optimizer state in place; return the saved state dict."""
    path = Path(path)
    weights = load_file(path / "trainable.safetensors")
    params = dict(model.named_parameters())
    unknown = sorted(set(weights) - set(params))
    if unknown:
        raise ValueError(f"checkpoint has parameters the model lacks: {unknown[:3]}")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].device))
    state = json.loads((path / "state.json").read_text())
    per_param: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in load_file(path / "optimizer.safetensors").items():
        index, name = key.split("/", 1)
        per_param.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": per_param, "param_groups": state.pop("param_groups")})
    return state
