"""Benchmarks and the references they (and the tests) compare against: per-stage latency vs
transformers, backends side by side, budgets, contention, the ablation, random models."""
