"""The metrics rows of two runs compared: the keys that measure time differ between equal runs."""

TIMING = ("tokens_per_s", "time_rollout", "time_logprobs", "time_train", "time_update_weights", "time_step",
          "wall_time", "time_rollout_wait", "at_next_rollout_issued", "at_train_end")


def without_timing(rows):
    """``rows`` (metrics.jsonl dicts) without their timing keys, for equality with another run's."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
