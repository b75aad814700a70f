"""DriveLM-style evaluation: metrics.py (pure scoring), data.py (QA files and images),
runner.py (feeds a Pipeline question by question), judge.py (the pluggable GPT scorer); for
questions about motion, one_frame.py (how much of them one frame's layout tells) and
motion_sheet.py (a picture of a scene's frame sets over time)."""
