"""The run's outputs: metrics (JSONL, TensorBoard, W&B), the samples log, the run summary and
the report read back from them."""
