"""Explanations drawn and published: the rig picture (picture.py), the Foxglove MCAP (foxglove_mcap.py),
and an answer with its explanation from a Pipeline (capture.py). The explanation itself is computed
in pipeline/explanation.py."""
