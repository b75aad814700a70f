"""Post-training quantization of an export bundle from real pipeline traffic, with NVIDIA ModelOpt,
in the order it runs:

    plan.py        CalibrationPlan: what to calibrate (precision, method, stages, data), checked first
    traffic.py     the questions; every stage call's graph inputs recorded; samples per graph
    quantize.py    each graph quantized from its samples (INT8/FP8 Q/DQ; INT4 weights written in)
    accuracy.py    held-out questions answered by the float and the quantized bundle
    calibrate.py   calibrate(plan): the above, top to bottom
    check.py       `calibrate --check`: every Q/DQ pair of a bundle executed as written
"""
