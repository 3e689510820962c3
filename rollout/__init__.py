"""The rollout side: engines that generate GRPO's samples and take the trainer's weights.

* :mod:`.plugin` - the built-in rollout-engine records (``--rollout-engine reference``, ``sglang``).
* :mod:`.reference_engine` - the engine protocol's types (``Sample``, ``SamplingParams``) and the built-in engine
  (KV-cached, batched; the ``true_on_policy`` engine that draws from the trainer's module);
  :mod:`.slot_decoder` (continuous batching, CUDA graphs), :mod:`.engine_ops` (its kernel choices),
  :mod:`.logprobs` (the log-prob op it shares with the trainer).
* :mod:`.sglang_engine`, :mod:`.sglang_guard` - the SGLang server adapter and the watchdog of a started server.
* :mod:`.weight_sync` - trainer weights -> export buckets -> publish -> engine -> check.
* :mod:`.async_rollout` - the next step's batch generated while the trainer trains.
* :mod:`.replay` - routing replay (R3) and the indexer-replay seam.
* :mod:`.rules` - the combination table's rollout rules.

It sits below the trainer (:mod:`train`) and above the backends: the trainer imports it, never the reverse.
"""
