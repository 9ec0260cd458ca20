"""The teacher service: a teacher model's logprobs of sampled tokens, for on-policy distillation."""
