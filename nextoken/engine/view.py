"""`EngineView`: what the inspector reads of an `LLMEngine`, read-only and by public names, so
the inspector never walks the engine's parts (its KV cache's block pool, its runner's model, ...).
Reads of the state that a step changes (the block pool, the running and waiting requests, the
step history) are made between steps (`AsyncLLMEngine.between_steps`) or accept a snapshot's
staleness (the live view)."""

from __future__ import annotations

import torch


class EngineView:
    """`engine`: an `LLMEngine`. The view adds no state; two views of one engine read the same."""

    def __init__(self, engine):
        self._engine = engine

    # -- what the engine is ------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self._engine.tokenizer

    @property
    def config(self):
        """The model's `ModelConfig`."""
        return self._engine.config

    @property
    def args(self):
        """The `EngineArgs` it was built from."""
        return self._engine.args

    @property
    def cache_config(self):
        return self._engine.cache_config

    @property
    def model_path(self):
        return self._engine.model_path

    @property
    def max_model_len(self) -> int:
        return self._engine.max_model_len

    @property
    def speculative(self):
        """The speculative-decoding configuration, or None."""
        return self._engine.speculative

    @property
    def sampler(self):
        """The engine's `Sampler` (its stages are taken apart on real logits)."""
        return self._engine.sampler

    @property
    def model(self) -> torch.nn.Module:
        """The model the runner computes with (its layers, weights in the plan's forms)."""
        return self._engine.runner.model

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the model's activations."""
        return self._engine.runner.dtype

    @property
    def tensor_parallel(self):
        """The tensor-parallel group, or None in one process."""
        return self._engine.runner.tp

    def plan_description(self) -> list:
        """The execution plan as it binds to this model (`runner.plan.ExecutionPlan.describe`)."""
        return self._engine.runner.plan.describe(self._engine.runner.model)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[n, vocab]`` of final hidden states ``[n, hidden]`` through the LM head."""
        runner = self._engine.runner
        return runner.model.compute_logits(hidden.to(runner.device.torch, runner.dtype)).float()

    def encode_prompt(self, prompt, params, truncate: bool = False) -> list[int]:
        return self._engine.encode_prompt(prompt, params, truncate)

    def sequence_grammar(self, spec):
        """A fresh matcher state for grammar `spec` (the engine's compiled-grammar cache)."""
        return self._engine.grammars.sequence_grammar(spec)

    # -- the KV cache ------------------------------------------------------------------------
    @property
    def kv_tensors(self):
        """The KV cache's tensors (`kv_cache.tensors`: block size, bytes per token, bytes)."""
        return self._engine.runner.kv

    @property
    def block_pool(self):
        """The block pool (free, cached, referenced blocks)."""
        return self._engine.kv.pool

    @property
    def block_size(self) -> int:
        return self._engine.kv.block_size

    def block_ids(self, request_id: str) -> list[int]:
        """The blocks of sequence `request_id` in order ([] when it holds none)."""
        return list(self._engine.kv.block_ids(request_id))

    @property
    def sliding_pool(self):
        """The sliding-window layers' block pool (None for a model without such layers)."""
        return self._engine.kv.sliding_pool

    def ring(self, request_id: str) -> dict | None:
        """Sequence `request_id`'s sliding-window blocks (`kv_cache.manager.Ring`): its slots'
        block ids, the logical blocks they hold (None: not written yet) and this step's blocks
        outside them; None when it holds none."""
        kv = self._engine.kv
        ring = kv.rings.get(request_id)
        if ring is None:
            return None
        held = ring.held(kv.ring_blocks)
        return {"slots": [b.block_id for b in ring.slots], "logical": [held.get(s) for s in range(len(ring.slots))],
                "off_ring": {str(j): b.block_id for j, b in sorted(ring.off_ring.items())}}

    # -- requests and steps ------------------------------------------------------------------
    @property
    def running(self) -> list:
        return list(self._engine.scheduler.running)

    @property
    def waiting(self) -> list:
        return list(self._engine.scheduler.waiting)

    @property
    def history(self):
        """The recent steps and requests (`engine.step_stats.StepHistory`)."""
        return self._engine.history

    @property
    def num_steps(self) -> int:
        return self._engine.num_steps

    def stats(self) -> dict:
        return self._engine.stats()
