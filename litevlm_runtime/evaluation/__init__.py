"""DriveLM-style evaluation: metrics.py (pure scoring), data.py (QA files and images),
runner.py (feeds a Pipeline question by question), judge.py (the pluggable GPT scorer)."""
