"""Evaluation with lm-evaluation-harness: a native tformer model class and tformer's own small tasks."""
