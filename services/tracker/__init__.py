"""The tracker service: a run's metrics and completions in TensorBoard, Weights & Biases and trackio."""
