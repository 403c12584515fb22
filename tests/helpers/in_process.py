"""A model built, loaded and packed in this process at TP 1 (no ranks, no engine): for tests that call its layers."""

from __future__ import annotations

import torch


def loaded_model(folder, **config):
    """The model at `folder` (a safetensors folder or a GGUF file: loaders.gguf_file.open_checkpoint), every weight
    read and packed for its kernels, as one rank of TP 1 holds it. `config`: EngineConfig fields (e.g. dtype)."""
    from loaders.gguf_file import open_checkpoint
    from sharding.dist import Dist
    from sharding.layers.interface import Loadable, Packable
    from sharding.runner import EngineConfig, build_model

    with open_checkpoint(folder) as ckpt:
        model, _, _ = build_model(EngineConfig(str(folder), **config), Dist(rank=0, world_size=1,
                                                                            device=torch.device("cpu")), ckpt)
        for m in model.modules():
            if isinstance(m, Loadable):
                m.load(ckpt)
    for m in model.modules():
        if isinstance(m, Packable):
            m.prepack()
    return model
