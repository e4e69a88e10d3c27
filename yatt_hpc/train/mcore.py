"""Megatron-Core, imported without compiling anything at import time.

    from yatt_hpc.train.mcore import parallel_state, tensor_parallel   # instead of megatron.core

``megatron/core/jit.py`` binds ``jit_fuser = torch.compile`` (torch >= 2.2), and a dozen modules decorate
fusion helpers with it when they are imported (``fusions/fused_bias_geglu.py`` is the first). Decorating
with ``torch.compile`` imports ``torch._dynamo`` and ``torch._inductor``: measured here, ``import
megatron.core.models.gpt`` takes 8.6 s with it and 3.3 s without; a trainer rank's whole start
(Megatron, our modules, an AdamW) went from 9.9 s to 7.3 s, on every rank at every start. (``torch.optim``
would import ``torch._dynamo`` anyway, from ``_disable_dynamo`` around its methods: the trainer's AdamW
is ``optim/adamw.py``, which does not.)

So the first import of ``megatron.core`` in a process runs with ``torch.compile`` replaced by a
decorator that calls the real ``torch.compile`` on the decorated function's first call, with the same
arguments. ``torch.compile`` itself only traces on the first call, so what runs is unchanged: a fused
helper used on a GPU is compiled exactly as before, one never called is never compiled, and
``torch.compile`` is restored as soon as the import returns. Import Megatron through this module (the
trainer's modules do); a test checks ``torch._dynamo`` stays unloaded (tests/unit/test_startup_imports.py).
"""
from __future__ import annotations

import functools
import sys

import torch


def _deferred_compile(real):
    def compile_on_first_call(fn=None, **options):
        if fn is None:  # used as @torch.compile(mode=...)
            return lambda f: compile_on_first_call(f, **options)
        compiled = []

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not compiled:
                compiled.append(real(fn, **options))
            return compiled[0](*args, **kwargs)

        return call

    return compile_on_first_call


def _import_megatron_core():
    if "megatron.core.jit" in sys.modules:  # someone imported it first: nothing to defer any more
        import megatron.core

        return megatron.core
    real = torch.compile
    torch.compile = _deferred_compile(real)
    try:
        import megatron.core
    finally:
        torch.compile = real
    return megatron.core


_import_megatron_core()

# What the trainer uses, imported after the deferral above (hence E402).
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.utils import GlobalMemoryBuffer  # noqa: E402

__all__ = [
    "DotProductAttention", "GPTModel", "GlobalMemoryBuffer", "ModuleSpec", "MoELayer", "RotaryEmbedding", "TopKRouter",
    "TransformerConfig",
    "get_gpt_layer_local_spec", "parallel_state", "tensor_parallel",
]
