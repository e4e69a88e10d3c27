"""An engine that answers each turn with a scripted text: the agent loop's robustness cases without a model.

    engine = ScriptedEngine(tokenizer, {sample_id: ["<call>{...}</call>", "bdc"]})   # turn k -> text k

Each turn's text is encoded, ends with the tokenizer's first EOS (`finish_reason` stop; `"...|length"` ends the
turn at its cap instead), and gets logprob -0.5 per token; `seen` keeps every request's prompt ids.
"""
from __future__ import annotations

import numpy as np

from yatt_hpc.rollout.engine import BaseEngine, GenerationResult


class ScriptedEngine(BaseEngine):
    def __init__(self, tokenizer, scripts: dict[int, list[str]]) -> None:
        self.tokenizer, self.scripts, self.turn = tokenizer, scripts, {}
        self.seen: list = []

    def generate(self, requests, on_result=None, on_step=None):
        out = []
        for r in requests:
            k = self.turn.get(r.sample_id, 0)
            self.turn[r.sample_id] = k + 1
            self.seen.append(r)
            text = self.scripts[r.sample_id][min(k, len(self.scripts[r.sample_id]) - 1)]
            cut = text.endswith("|length")
            ids = self.tokenizer.encode(text.removesuffix("|length")) + ([] if cut else [self.tokenizer.eos_ids[0]])
            ids = ids[:r.max_new_tokens]
            out.append(GenerationResult(r.sample_id, r.prompt_ids, np.asarray(ids, np.int32),
                                        np.full(len(ids), -0.5, np.float32),
                                        "length" if cut or len(ids) == r.max_new_tokens else "stop", 0))
        return out

    def abort(self): ...
    def update_weights(self, named_tensors, *, final, version=None): ...
    @property
    def weight_version(self): return 0
    def release_memory(self): ...
    def resume_memory(self): ...
    def shutdown(self): ...
