"""Making deployment artefacts from a model folder: the per-stage ONNX bundle (exporter) and its
post-training quantization (calibration)."""
