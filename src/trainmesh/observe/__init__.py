"""What a run reports: metrics, progress, traces, TensorBoard, the HTML report, FLOPs/MFU.
Imports core and config only.
"""
